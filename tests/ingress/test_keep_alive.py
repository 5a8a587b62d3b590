"""An idle client connection stays open longer than clients pool idle ones (they close it first,
so no request goes out on a connection the server is closing), and the setting is the server's."""

from __future__ import annotations

import asyncio

from services.ingress.main import IngressSettings
from tests.ingress.helpers import ok_app, served

_REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _settings(keep_alive_s: int | None) -> IngressSettings:
    settings = IngressSettings()
    if keep_alive_s is None:
        return settings
    return settings.model_copy(update={"keep_alive_s": keep_alive_s})


async def _answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(_REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await reader.readexactly(2)  # the body, "ok"
    return head


async def test_the_setting_closes_idle_connections() -> None:
    keep_alive_s = 1
    async with served(ok_app, _settings(keep_alive_s)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(keep_alive_s + 0.6)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()


async def test_by_default_a_connection_idle_longer_than_uvicorns_5_s_still_serves() -> None:
    assert IngressSettings().keep_alive_s > 15  # aiohttp's pool keeps idle ones 15 s; httpx 5
    async with served(ok_app, _settings(None)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(6)
        assert (await _answered(reader, writer)).startswith(b"HTTP/1.1 200")
        writer.close()
