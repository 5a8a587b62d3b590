"""The body limit and the content type: refused before the body is read, or as soon as it passes
the limit, and in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import AsyncIterator

import orjson
import pytest
import uvicorn

from services.common.tokenizer import ByteTokenizer
from services.ingress.api import create_app
from services.ingress.settings import IngressApiSettings
from tests.helpers import eventually
from tests.ingress.fakes import FakeGateway
from tests.ingress.helpers import chat_body, harness

LIMIT = 64 * 1024
CHUNK = b" " * 4096
PATH = "/v1/chat/completions"


class SlowBody:
    """A request body sent a chunk at a time, counting what the app has taken."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.consumed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.consumed < self.size:
            await asyncio.sleep(0)
            self.consumed += len(CHUNK)
            yield CHUNK


def assert_too_large(status: int, body: bytes) -> None:
    assert status == 413
    error = orjson.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert str(LIMIT) in error["message"]


async def test_declared_length_over_the_limit_is_refused_unread() -> None:
    body = SlowBody(4 * LIMIT)
    headers = {"content-type": "application/json", "content-length": str(body.size)}
    async with harness(max_body_bytes=LIMIT) as h:
        response = await h.client.post(PATH, content=body, headers=headers)
    assert_too_large(response.status_code, response.content)
    assert body.consumed == 0
    assert h.gateway.submitted == []


async def test_chunked_body_is_refused_once_past_the_limit() -> None:
    body = SlowBody(4 * LIMIT)
    async with harness(max_body_bytes=LIMIT) as h:
        response = await h.client.post(
            PATH, content=body, headers={"content-type": "application/json"}
        )
    assert "content-length" not in response.request.headers
    assert_too_large(response.status_code, response.content)
    assert LIMIT < body.consumed <= LIMIT + len(CHUNK)


async def test_a_body_at_the_limit_is_taken() -> None:
    content = orjson.dumps(chat_body())
    async with harness(max_body_bytes=len(content)) as h:
        response = await h.client.post(
            PATH, content=content, headers={"content-type": "application/json"}
        )
    assert response.status_code == 200, response.text


@contextlib.asynccontextmanager
async def served(limit: int) -> AsyncIterator[int]:
    """The app behind a real HTTP server on a free port: its own reading and buffering count."""
    app = create_app(
        FakeGateway(), ByteTokenizer(), IngressApiSettings(instance_id="i", max_body_bytes=limit)
    )
    listener = socket.create_server(("127.0.0.1", 0))
    # A connection still sending must not hold up the shutdown when a test fails.
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    await eventually(lambda: server.started, interval=0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


async def post_chunked(port: int, size: int, frame: bytes) -> tuple[bytes, int]:
    """POST ``size`` bytes chunked, one ``frame`` at a time, stopping once the answer's head
    arrives; returns that head and the bytes sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n".encode()
    )
    head = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
    sent = 0
    try:
        while sent < size and not head.done():
            writer.write(frame)
            await writer.drain()
            sent += len(frame)
            await asyncio.sleep(0.001)
        return await asyncio.wait_for(head, 10), sent
    finally:
        writer.close()


async def test_a_chunked_body_over_the_limit_costs_the_server_at_most_the_limit() -> None:
    limit, size = 2 * 1024 * 1024, 16 * 1024 * 1024
    chunk = 65536
    frame = b"%x\r\n" % chunk + b" " * chunk + b"\r\n"
    async with served(limit) as port:
        tracemalloc.start()
        try:
            head, sent = await post_chunked(port, size, frame)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert sent < size / 2
    # Past the limit, the server holds what it has read but not yet parsed: asyncio reads up to
    # 256 KiB at a time, and the HTTP parser buffers a chunk.
    assert peak < limit + 512 * 1024


async def test_a_declared_length_over_the_limit_is_answered_before_any_body_is_sent() -> None:
    async with served(LIMIT) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {100 * LIMIT}\r\n\r\n".encode()
        )
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 413 "), head


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_a_body_that_is_not_json_is_refused(content_type: str) -> None:
    async with harness() as h:
        response = await h.client.post(
            PATH, content=orjson.dumps(chat_body()), headers={"content-type": content_type}
        )
    assert response.status_code == 415
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "unsupported_media_type")
    assert content_type in error["message"]
    assert "Content-Type: application/json" in error["message"]
    assert h.gateway.submitted == []


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
async def test_json_content_types_are_taken(content_type: str) -> None:
    async with harness() as h:
        response = await h.client.post(
            PATH, content=orjson.dumps(chat_body()), headers={"content-type": content_type}
        )
    assert response.status_code == 200, response.text


async def test_a_body_without_content_type_is_read_as_json() -> None:
    async with harness() as h:
        response = await h.client.post(PATH, content=orjson.dumps(chat_body()))
    assert "content-type" not in response.request.headers
    assert response.status_code == 200, response.text
