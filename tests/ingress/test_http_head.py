"""The head bounds of the ingress's HTTP server (services.ingress.http_head) on the cases the
live test leaves out: requests pipelined in one write, a head refused while an earlier request is
still being answered, a connection idle between requests (the keep-alive timeout's, not the
head timeout's), and the head buffer given back on each way a head ends."""

from __future__ import annotations

import asyncio
import socket
import struct

from starlette.types import Receive, Scope, Send

from services.ingress.main import IngressSettings
from tests.ingress.helpers import served

_SETTINGS = IngressSettings().model_copy(
    update={
        "header_timeout_s": 0.5,
        "max_header_bytes": 2000,
        "max_headers": 10,
        # Room for two heads just under the limit, held between reads.
        "head_buffer_bytes": 4000,
    }
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


# Two heads just under the limit fill it; each case below ends one of them in its own way, where
# a head held for more than the timeout would end in a 408 as well.
_BUFFER = _SETTINGS.model_copy(update={"header_timeout_s": 1.5})
_PARTIAL = b"GET /held HTTP/1.1\r\nHost: x\r\nX-Pad: "
_HELD = len(_PARTIAL) + 1800  # 1,834 bytes


async def _holding(port: int, pad: int = 1800) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose unfinished head the server holds: same loop, the sleep lets it read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_PARTIAL + b"a" * pad)
    await asyncio.sleep(0.05)
    return reader, writer


async def _finish(
    held: tuple[asyncio.StreamReader, asyncio.StreamWriter], close: bool = True
) -> bytes:
    """The end of a held head, and the answer (to the connection's end where it was refused)."""
    reader, writer = held
    try:
        writer.write(b"\r\n\r\n")
        return await asyncio.wait_for(reader.readuntil(b"/held"), 2)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        return getattr(exc, "partial", b"")
    finally:
        if close:
            writer.close()


async def _fits(port: int, pad: int = 1800) -> bool:
    """Whether the buffer has room for one more head of ``pad`` bytes and more: sent in two
    reads, it is served (200) rather than refused (503)."""
    answer = await _finish(await _holding(port, pad))
    assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 503 ")), answer[:100]
    return answer.startswith(b"HTTP/1.1 200 ")


async def _full(port: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    held = [await _holding(port), await _holding(port)]
    assert not await _fits(port)
    return held


async def test_heads_past_the_buffer_are_refused_with_503_at_once() -> None:
    async with served(_path_app, _BUFFER) as port:
        held = await _full(port)
        reader, writer = await _holding(port)
        answer = await asyncio.wait_for(reader.read(), 2)  # answered, and closed
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:100]
        assert b"\r\nretry-after: 1\r\n" in answer
        assert b'"code":"head_buffer_full"' in answer
        assert b'"type":"service_unavailable_error"' in answer
        # A head that comes in one read is never held: served however full the buffer is.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/whole"))
        assert (await asyncio.wait_for(reader.readuntil(b"/whole"), 2)).startswith(b"HTTP/1.1 200")
        writer.close()
        for each in held:
            assert (await _finish(each)).startswith(b"HTTP/1.1 200 ")


async def test_the_head_buffer_is_given_back_however_a_head_ends() -> None:
    async with served(_path_app, _BUFFER) as port:
        # Completed: served, and what it held given back, the connection still open. (In each
        # case a connection ended by the server is closed by the test only once the room is
        # seen: its close gives back what it held too.)
        first, second = await _full(port)
        assert (await _finish(first, close=False)).startswith(b"HTTP/1.1 200 ")
        assert await _fits(port)
        first[1].close()
        await _finish(second)
        # Closed by the client, with a reset.
        first, second = await _full(port)
        first[1].get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        first[1].transport.abort()
        await asyncio.sleep(0.05)
        assert await _fits(port)
        await _finish(second)
        # Refused for its own size (431).
        first, second = await _full(port)
        first[1].write(b"a" * 500)
        assert (await asyncio.wait_for(first[0].read(), 2)).startswith(b"HTTP/1.1 431 ")
        assert await _fits(port)  # given back at once, not at the close after the linger
        first[1].close()
        await _finish(second)
        # Refused for the buffer: a third head is held within the room left, refused once it
        # grows past it, and what it held given back (as much fits again).
        held = await _full(port)
        room = _BUFFER.head_buffer_bytes - 2 * _HELD - len(_PARTIAL)
        third = await _holding(port, room - 50)
        third[1].write(b"a" * 100)
        assert (await asyncio.wait_for(third[0].read(), 2)).startswith(b"HTTP/1.1 503 ")
        assert await _fits(port, room - 50)
        third[1].close()
        # Timed out (408).
        for reader, _ in held:
            assert (await asyncio.wait_for(reader.read(), 3)).startswith(b"HTTP/1.1 408 ")
        for _, writer in [*held, *await _full(port)]:
            writer.close()


async def test_a_head_begun_in_the_read_that_ends_a_request_is_counted() -> None:
    """A request and the next one's unfinished head in one read, or a body's end and the next
    head: the head is counted from where it began, not from the next read (counted from there,
    it held the buffer uncounted, and could go past the per-connection limit)."""
    async with served(_path_app, _BUFFER) as port:
        ahead = [
            _get("/a"),
            b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + b"\r\n\r\n" * 2 + b"{}",
        ]
        held = []
        for before in ahead:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(before + _PARTIAL + b"a" * 1800)
            await asyncio.sleep(0.05)
            held.append((reader, writer))
        assert not await _fits(port)
        for _, writer in held:
            writer.close()
        # A head begun in a read that starts in a body is refused past the limit at once.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        await asyncio.sleep(0.05)
        writer.write(b"        }" + _PARTIAL + b"a" * 5000)
        answer = await asyncio.wait_for(reader.read(), 1)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 431 " in answer, answer[-300:]


async def test_a_head_begun_behind_an_answer_gets_the_head_timeout_once_it_is_answered() -> None:
    async with served(_path_app, _SETTINGS) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get("/slow") + _PARTIAL)
        # The answer, then a 408 after the head timeout, not the keep-alive timeout's close.
        answer = await asyncio.wait_for(reader.read(), _SETTINGS.header_timeout_s + 1.5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in answer, answer[-200:]
