"""The head bounds of the ingress's HTTP server (services.ingress.http_head) on the cases the
live test leaves out: requests pipelined in one write, a head refused while an earlier request is
still being answered, and a connection idle between requests (the keep-alive timeout's, not the
head timeout's)."""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send

from services.ingress.main import IngressSettings
from tests.ingress.helpers import served

_SETTINGS = IngressSettings().model_copy(
    update={"header_timeout_s": 0.5, "max_header_bytes": 2000, "max_headers": 10}
)


async def _path_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers each request with its path, ``/slow`` after 0.3 s."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(0.3)
    body = scope["path"].encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def test_pipelined_requests_are_each_answered() -> None:
    async with served(_path_app, _SETTINGS) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/a") + _get("/slow") + _get("/c"))
        answers = b""
        while not answers.endswith(b"/c"):
            answers += await asyncio.wait_for(reader.read(4096), 2)
        assert answers.count(b"HTTP/1.1 200 ") == 3
        writer.close()


async def test_a_head_over_the_limit_behind_an_answer_in_progress_closes_after_it() -> None:
    async with served(_path_app, _SETTINGS) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/slow") + b"GET /big HTTP/1.1\r\nX-Big: " + b"a" * 5000)
        answer = await asyncio.wait_for(reader.read(), 2)
        # The earlier request's answer, whole, then the end of the connection.
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\n/slow")
        writer.close()


async def test_an_idle_connection_outlives_the_head_timeout() -> None:
    async with served(_path_app, _SETTINGS) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/a"))
        assert (await asyncio.wait_for(reader.readuntil(b"/a"), 2)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(_SETTINGS.header_timeout_s * 2)
        writer.write(_get("/b"))
        assert (await asyncio.wait_for(reader.readuntil(b"/b"), 2)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_eleven_headers_are_refused_and_ten_served() -> None:
    async with served(_path_app, _SETTINGS) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        headers = b"".join(b"X-%d: 1\r\n" % i for i in range(9))
        writer.write(b"GET /ten HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"/ten"), 2)).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /eleven HTTP/1.1\r\nHost: x\r\nX-9: 1\r\n" + headers + b"\r\n")
        answer = await asyncio.wait_for(reader.read(), 2)
        assert answer.startswith(b"HTTP/1.1 431 ")
        assert b'"request_header_fields_too_large"' in answer
        writer.close()
