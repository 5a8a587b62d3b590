"""The in-memory broker's pieces (bus.memory): subject matching, a subscription, a stream, a
durable."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, StreamConfig

from bus.channels import matches
from bus.client import MSG_ID_HEADER

if TYPE_CHECKING:
    from bus.memory_client import MemoryClient

Callback = Callable[[Msg], Awaitable[None]]


class Subscription:
    """One subscription: its messages queued in order, its callback run on each in turn."""

    def __init__(self, client: MemoryClient, subject: str, queue: str, cb: Callback) -> None:
        self.client, self.subject, self.queue, self._cb = client, subject, queue, cb
        self.broker = client.broker
        self._inbox: asyncio.Queue[Msg] = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    def put(self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        self._inbox.put_nowait(Msg(self.client, subject, reply, data, headers))  # type: ignore[arg-type]

    async def _run(self) -> None:
        while True:
            msg = await self._inbox.get()
            try:
                await self._cb(msg)
            except Exception:  # nats-py logs a failing callback and goes on with the next
                self.broker.callback_errors += 1
            finally:
                self._inbox.task_done()

    async def settled(self) -> None:
        await self._inbox.join()

    async def unsubscribe(self) -> None:
        self.broker.drop(self)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@dataclass
class Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None


@dataclass
class Stream:
    config: StreamConfig
    messages: dict[int, Stored] = field(default_factory=dict)
    last_seq: int = 0
    ids: dict[str, tuple[int, float]] = field(default_factory=dict)

    def takes(self, subject: str) -> bool:
        return any(matches(p, subject) for p in self.config.subjects or ())

    def store(self, subject: str, data: bytes, headers: dict[str, str] | None) -> tuple[int, bool]:
        """The message's sequence, and whether it was a copy of one stored within the window."""
        now = time.monotonic()
        msg_id = (headers or {}).get(MSG_ID_HEADER)
        window = self.config.duplicate_window or 120.0
        if msg_id is not None:
            seen = self.ids.get(msg_id)
            if seen is not None and now - seen[1] < window:
                return seen[0], True
        self.last_seq += 1
        if self.config.max_msgs_per_subject == 1:
            for seq in [s for s, m in self.messages.items() if m.subject == subject]:
                del self.messages[seq]
        self.messages[self.last_seq] = Stored(self.last_seq, subject, data, headers)
        if msg_id is not None:
            self.ids[msg_id] = (self.last_seq, now)
        return self.last_seq, False


@dataclass
class Durable:
    stream: str
    config: ConsumerConfig
    delivered: int = 0  # the stream sequence handed out last
    # Stream sequence → times delivered, for those not acked yet.
    unacked: dict[int, int] = field(default_factory=dict)
    due: list[int] = field(default_factory=list)  # to deliver again, in order
    timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def ack_wait_s(self) -> float:
        return self.config.ack_wait or 30.0

    def stop_timer(self, seq: int) -> None:
        """No redelivery of ``seq`` is due any more (acked, or given a new time)."""
        timer = self.timers.pop(seq, None)
        if timer is not None:
            timer.cancel()
