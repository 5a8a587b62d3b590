"""`at_server`: what a connection sent is at the server when it returns. Checked against a
server that records the order of the commands it reads, since the race it closes (the server
reading a SUB after the PONG of a flush) cannot be forced on a real one."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.msg import Msg

from bus.client import at_server


@pytest.mark.parametrize("flushes", ["at_server", "flush"])
async def test_a_subscription_is_read_before_the_last_ping(flushes: str) -> None:
    read: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"fake","version":"2.10.0","max_payload":1048576}\r\n')
        while line := await reader.readline():
            command = line.split()[0].decode()
            read.append(command)
            if command == "PING":
                writer.write(b"PONG\r\n")

    async def ignore(_msg: Msg) -> None:
        pass

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    try:
        read.clear()  # the handshake's own PING
        await nc.subscribe("lw.x", cb=ignore)
        await (at_server(nc) if flushes == "at_server" else nc.flush())
        await asyncio.sleep(0.05)  # the flusher's late write, if any, is read too
        sub, last_ping = read.index("SUB"), len(read) - 1 - read[::-1].index("PING")
        # nats-py's own flush sends its PING ahead of the queued SUB; at_server's last follows it.
        assert (sub < last_ping) is (flushes == "at_server"), read
    finally:
        await nc.close()
        server.close()
