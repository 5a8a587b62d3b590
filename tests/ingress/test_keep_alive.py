"""An idle client connection stays open longer than clients pool idle ones (they close it first,
so no request goes out on a connection the server is closing), and the setting is the server's."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from services.ingress.acceptor import EagerAcceptServer
from services.ingress.main import IngressSettings, http_config
from tests.ingress.helpers import ok_app

_REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _serving(keep_alive_s: int | None) -> AsyncIterator[int]:
    settings = IngressSettings(host="127.0.0.1", port=0)
    if keep_alive_s is not None:
        settings = settings.model_copy(update={"keep_alive_s": keep_alive_s})
    listener = socket.create_server(("127.0.0.1", 0))
    server = EagerAcceptServer(http_config(ok_app, settings))
    server.config.lifespan = "off"
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


async def _answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(_REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await reader.readexactly(2)  # the body, "ok"
    return head


async def test_the_setting_closes_idle_connections() -> None:
    keep_alive_s = 1
    async for port in _serving(keep_alive_s):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(keep_alive_s + 0.6)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()


async def test_by_default_a_connection_idle_longer_than_uvicorns_5_s_still_serves() -> None:
    assert IngressSettings().keep_alive_s > 15  # aiohttp's pool keeps idle ones 15 s; httpx 5
    async for port in _serving(None):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(6)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        writer.close()
