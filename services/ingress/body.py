"""A completion request's body, read only if it is JSON and never past the size limit.

The limit is enforced while reading rather than after: a declared ``Content-Length`` over it is
refused before a byte is read (a client that sent ``Expect: 100-continue`` never sends the body),
and a body without one (chunked) is refused as soon as the bytes received pass it, so an
oversized body costs at most the limit in memory.
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from services.ingress.errors import body_too_large, unsupported_media_type

_JSON = "application/json"
# The request headers a completion endpoint reads.
_READ = frozenset({b"content-type", b"content-length", b"x-session-id", b"x-laneway-priority"})


def request_headers(scope: Scope) -> dict[bytes, str]:
    """The headers a completion endpoint reads, picked in one pass (the first of a repeated
    one, as Starlette's ``Headers.get``); names are lower-case, as ASGI servers give them."""
    picked: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _READ and name not in picked:
            picked[name] = value.decode("latin-1")
    return picked


async def read_json_body(headers: dict[bytes, str], receive: Receive, limit: int) -> bytes:
    """The body of the request; raises ApiError 415 for a non-JSON Content-Type, 413 for a body
    over ``limit`` bytes, and ClientDisconnect if the client leaves while sending it."""
    content_type = headers.get(b"content-type")
    # No Content-Type is taken as JSON, as FastAPI-based servers do: a hand-written client that
    # sends JSON without naming it still works, and the parser judges what it sent.
    if content_type is not None and content_type.partition(";")[0].strip().lower() != _JSON:
        raise unsupported_media_type(content_type)
    declared = headers.get(b"content-length")
    # The HTTP server has already refused a malformed Content-Length.
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
