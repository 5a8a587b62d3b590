"""The ingress's HTTP server takes a burst of waiting connections within a few turns of a busy
event loop (uvloop's own server takes one a turn), serves them, and stops cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import uvicorn
import uvloop

from services.ingress.acceptor import ACCEPTS_PER_TURN, EagerAcceptServer
from tests.ingress.helpers import ok_app

PENDING = 300


def _config() -> uvicorn.Config:
    return uvicorn.Config(ok_app, lifespan="off", log_level="warning", http="httptools")


async def _turns_to_accept() -> int:
    """Turns of a loop whose every turn costs 5 ms until PENDING waiting connections are in."""
    listener = socket.create_server(("127.0.0.1", 0))  # listens with a backlog of 128
    port = listener.getsockname()[1]
    server = EagerAcceptServer(_config())
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    # Handshaken by the kernel at once (loopback), waiting in the listen backlog as the busy
    # turns begin.
    clients = [socket.socket() for _ in range(PENDING)]
    for client in clients:
        client.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            client.connect(("127.0.0.1", port))
    turns = 0
    try:
        while len(server.server_state.connections) < PENDING and turns < PENDING:
            time.sleep(0.005)  # this turn's work for the streams already served
            turns += 1
            await asyncio.sleep(0)
        return turns
    finally:
        for client in clients:
            client.close()
        server.should_exit = True
        await serving


def test_a_burst_of_connections_is_taken_within_a_few_turns() -> None:
    # uvloop's own server (uvicorn.Server) takes one connection a turn: ~PENDING turns here.
    assert uvloop.run(_turns_to_accept()) <= PENDING // ACCEPTS_PER_TURN + 5


async def test_serves_requests_and_stops() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = EagerAcceptServer(_config())
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)

    async def get() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
        return answer

    answers = await asyncio.gather(*(get() for _ in range(20)))
    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"\r\n\r\nok") for a in answers)
    server.should_exit = True
    await asyncio.wait_for(serving, 5)
    assert listener.fileno() == -1  # closed: nothing listens any more
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
