"""A client connection's writes of one turn of the event loop, written at its end as one.

uvicorn writes a response's head when it is sent and each body part as it is sent, so a streamed
answer's head and its first event went out as two writes, and so did its last tokens and its end
when they came together: a system call each, and a wake-up of the client each. Held until the
loop's turn ends, they go out together; nothing waits longer than the turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, cast


class CoalescingTransport(asyncio.Transport):
    """``transport``, its writes of a turn joined (closing writes what is held first)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._held: list[bytes | bytearray | memoryview] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self._write_held)
        self._held.append(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def _write_held(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._write_held()
        self._transport.close()

    def write_eof(self) -> None:
        self._write_held()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


class CoalescedProtocol(asyncio.Protocol):
    """``protocol`` given a :class:`CoalescingTransport` for its connection's transport; every
    call from that transport (the flow control's pause and resume too) passed on to it."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: asyncio.Protocol) -> None:
        self._protocol = protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no asyncio.Transport subclasses, but behave as one.
        self._protocol.connection_made(CoalescingTransport(cast(asyncio.Transport, transport)))

    def data_received(self, data: bytes) -> None:
        self._protocol.data_received(data)

    def eof_received(self) -> bool | None:
        return self._protocol.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self._protocol.pause_writing()

    def resume_writing(self) -> None:
        self._protocol.resume_writing()


def coalesced(factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
    return lambda: CoalescedProtocol(factory())
