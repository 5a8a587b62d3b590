"""A client connection's writes of one turn of the loop go out as one, in order; closing writes
what is held first, aborting drops it."""

from __future__ import annotations

import asyncio
from typing import cast

from services.ingress.coalesce import CoalescedProtocol, CoalescingTransport


class _Recording:
    """The transport's side: what was written, in calls."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0


def _transport() -> tuple[CoalescingTransport, _Recording]:
    inner = _Recording()
    return CoalescingTransport(cast(asyncio.Transport, inner)), inner


async def test_a_turns_writes_are_one_write_in_order() -> None:
    transport, inner = _transport()
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.writelines([b"data: 1\n\n", b""])
    assert inner.writes == [] and transport.get_write_buffer_size() == 28
    await asyncio.sleep(0)
    transport.write(b"data: 2\n\n")
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\ndata: 1\n\n", b"data: 2\n\n"]


async def test_closing_writes_what_is_held_and_aborting_drops_it() -> None:
    transport, inner = _transport()
    transport.write(b"end")
    transport.close()
    assert inner.writes == [b"end"] and inner.closed
    await asyncio.sleep(0)
    assert inner.writes == [b"end"]
    transport, inner = _transport()
    transport.write(b"lost")
    transport.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.aborted


async def test_the_protocol_gets_the_coalescing_transport_and_every_call() -> None:
    calls: list[str] = []

    class Inner(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            calls.append(type(transport).__name__)

        def data_received(self, data: bytes) -> None:
            calls.append(data.decode())

        def pause_writing(self) -> None:
            calls.append("pause")

        def resume_writing(self) -> None:
            calls.append("resume")

        def connection_lost(self, exc: Exception | None) -> None:
            calls.append("lost")

    protocol = CoalescedProtocol(Inner())
    protocol.connection_made(cast(asyncio.Transport, _Recording()))
    protocol.data_received(b"GET")
    protocol.pause_writing()
    protocol.resume_writing()
    protocol.connection_lost(None)
    assert calls == ["CoalescingTransport", "GET", "pause", "resume", "lost"]
