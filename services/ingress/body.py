"""A completion request's body, read only if it is JSON and never past the size limit.

The limit is enforced while reading rather than after: a declared ``Content-Length`` over it is
refused before a byte is read (a client that sent ``Expect: 100-continue`` never sends the body),
and a body without one (chunked) is refused as soon as the bytes received pass it, so an
oversized body costs at most the limit in memory.
"""

from __future__ import annotations

from contextlib import aclosing

from starlette.requests import Request

from services.ingress.errors import body_too_large, unsupported_media_type

_JSON = "application/json"


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body of ``request``; raises ApiError 415 for a non-JSON Content-Type, 413 for a body
    over ``limit`` bytes, and ClientDisconnect if the client leaves while sending it."""
    headers = request.headers
    content_type = headers.get("content-type")
    # No Content-Type is taken as JSON, as FastAPI-based servers do: a hand-written client that
    # sends JSON without naming it still works, and the parser judges what it sent.
    if content_type is not None and content_type.partition(";")[0].strip().lower() != _JSON:
        raise unsupported_media_type(content_type)
    declared = headers.get("content-length")
    # The HTTP server has already refused a malformed Content-Length.
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async with aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    return b"".join(chunks)
