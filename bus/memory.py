"""An in-memory bus: the part of NATS and JetStream that Laneway relies on, in one process, under
the very :class:`bus.client.Bus` the services use (``MemoryBroker().connect(name)``), for tests of
service logic that need the bus's behaviour and not a server's.

It stands in below the bus, for nats-py's client, so that everything above (typed dispatch,
decoding and drops, confirmed publishes, acks, request/reply) runs as it does on NATS. What it
keeps of the server:

- subjects with ``*`` and ``>`` wildcards; queue groups (each message to one member, in turn);
  a subscription's callbacks one after the other, in publish order;
- request/reply through inboxes, and a request nobody takes answered "no responders";
- the topology's streams storing what is published to their subjects, with sequence numbers; a
  message id's copy dropped within the stream's duplicate window; only the newest message per
  subject where the stream keeps only that; a publish with a reply answered by the stream's
  PubAck, as JetStream's publish is, or its refusal where the publish expected another stream;
- push durables (``add_consumer``) delivering each stored message to one subscriber of their
  deliver subject (its group's), held while none listens; ``+ACK``, ``-NAK`` with a delay,
  ``+TERM``, and redelivery past the ack wait;
- ordered replay of a stream from a sequence on, then live (``js.subscribe``).

What it leaves out: byte, age and payload limits, clustering and leaders, the object store,
permissions and auth. Tests of those run on a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import nats.errors
import orjson
from nats.aio.msg import Msg
from nats.js.api import (
    ConsumerConfig,
    ConsumerInfo,
    PubAck,
    RawStreamMsg,
    StreamConfig,
    StreamInfo,
    StreamState,
)
from nats.js.errors import NoStreamResponseError, NotFoundError

from bus.client import MSG_ID_HEADER, Bus
from bus.topology import STREAM_SUBJECTS

Callback = Callable[[Msg], Awaitable[None]]
_ACK_PREFIX = "$JS.ACK."
# A publisher's condition that the message land in this stream: refused otherwise.
_EXPECTED_STREAM = "Nats-Expected-Stream"
_MAX_PAYLOAD = 8 * 1024 * 1024


def matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one of ``pattern``'s (NATS wildcards: ``*`` one token, ``>`` the
    rest)."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class _Subscription:
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
class _Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None


@dataclass
class _Stream:
    config: StreamConfig
    messages: dict[int, _Stored] = field(default_factory=dict)
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
        self.messages[self.last_seq] = _Stored(self.last_seq, subject, data, headers)
        if msg_id is not None:
            self.ids[msg_id] = (self.last_seq, now)
        return self.last_seq, False


@dataclass
class _Durable:
    stream: str
    config: ConsumerConfig
    delivered: int = 0  # the stream sequence handed out last
    # Stream sequence → times delivered, for those not acked yet.
    unacked: dict[int, int] = field(default_factory=dict)
    due: list[int] = field(default_factory=list)  # to deliver again, in order
    timers: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    created: datetime = field(default_factory=lambda: datetime.now(UTC))


class MemoryBroker:
    """The server: the topology's streams, every connection's subscriptions, the durables."""

    def __init__(self) -> None:
        self.streams = {
            s.name: _Stream(s.config(list(subjects))) for s, subjects in STREAM_SUBJECTS.items()
        }
        self.subs: list[_Subscription] = []
        self.durables: dict[str, _Durable] = {}
        self._turns = itertools.count()
        self._inboxes = itertools.count()
        self.callback_errors = 0
        # Each ordered replay, and what brings it up to its stream's newest message.
        self._replays: list[tuple[_Subscription, Callable[[], None]]] = []

    def connect(self, name: str = "memory") -> Bus:
        """A connection of its own, as ``Bus.connect`` makes one; the streams and durables are
        the broker's, so that services on connections of one broker meet."""
        return Bus(MemoryClient(self, name))  # type: ignore[arg-type]

    def new_inbox(self) -> str:
        return f"_INBOX.memory.{next(self._inboxes)}"

    def drop(self, sub: _Subscription) -> None:
        if sub in self.subs:
            self.subs.remove(sub)
        self._replays = [(r, follow) for r, follow in self._replays if r is not sub]

    def subscribe(
        self, client: MemoryClient, subject: str, queue: str, cb: Callback
    ) -> _Subscription:
        sub = _Subscription(client, subject, queue, cb)
        self.subs.append(sub)
        for durable in self.durables.values():
            if durable.config.deliver_subject == subject:
                self._pump(durable)
        return sub

    def publish(
        self, client: MemoryClient, subject: str, data: bytes, reply: str, headers: Any
    ) -> None:
        if subject.startswith(_ACK_PREFIX):
            self._acked(subject, data)
            return
        heard = self._to_subscribers(client, subject, data, reply, headers)
        stream = next((s for s in self.streams.values() if s.takes(subject)), None)
        expected = (headers or {}).get(_EXPECTED_STREAM)
        if stream is not None and expected not in (None, stream.config.name):
            if reply:
                refusal = {
                    "code": 400,
                    "err_code": 10060,
                    "description": "expected stream does not match",
                }
                self._to_subscribers(client, reply, orjson.dumps({"error": refusal}), "", None)
        elif stream is not None:
            seq, copy = stream.store(subject, data, headers)
            if reply:
                ack: dict[str, Any] = {"stream": stream.config.name, "seq": seq}
                ack |= {"duplicate": True} if copy else {}
                self._to_subscribers(client, reply, orjson.dumps(ack), "", None)
            if not copy:
                for durable in self.durables.values():
                    if durable.stream == stream.config.name:
                        self._pump(durable)
                for _, follow in self._replays:
                    follow()
        elif reply and not heard:
            self._to_subscribers(client, reply, b"", "", {"Status": "503"})

    def _to_subscribers(
        self, client: MemoryClient, subject: str, data: bytes, reply: str, headers: Any
    ) -> bool:
        groups: dict[str, list[_Subscription]] = {}
        for sub in self.subs:
            if matches(sub.subject, subject):
                groups.setdefault(sub.queue, []).append(sub)
        for queue, members in groups.items():
            chosen = members if not queue else [members[next(self._turns) % len(members)]]
            for sub in chosen:
                sub.put(subject, reply, data, headers)
        return bool(groups)

    # -- durables -------------------------------------------------------------------------

    def add_durable(self, stream: str, config: ConsumerConfig) -> None:
        assert config.durable_name is not None
        found = self.durables.get(config.durable_name)
        if found is None:
            self.durables[config.durable_name] = _Durable(stream, config)
        else:
            found.config = config

    def _pump(self, durable: _Durable) -> None:
        """Hand each message the durable has not delivered (and each due again) to one
        subscriber of its deliver subject; with none, they wait."""
        config = durable.config
        members = [s for s in self.subs if s.subject == config.deliver_subject]
        if not members:
            return
        stream = self.streams[durable.stream]
        later = [s for s in stream.messages if s > durable.delivered]
        for seq in [*durable.due, *later]:
            durable.delivered = max(durable.delivered, seq)
            stored = stream.messages.get(seq)
            if stored is None or not matches(config.filter_subject or ">", stored.subject):
                continue
            times = durable.unacked.get(seq, 0) + 1
            durable.unacked[seq] = times
            reply = (
                f"{_ACK_PREFIX}{durable.stream}.{config.durable_name}.{times}.{seq}.{seq}."
                f"{time.time_ns()}.0"
            )
            member = members[next(self._turns) % len(members)]
            member.put(stored.subject, reply, stored.data, stored.headers)
            self._redeliver_after(durable, seq, config.ack_wait or 30.0)
        durable.due.clear()

    def _redeliver_after(self, durable: _Durable, seq: int, delay_s: float) -> None:
        timer = durable.timers.pop(seq, None)
        if timer is not None:
            timer.cancel()

        def again() -> None:
            durable.timers.pop(seq, None)
            if seq in durable.unacked:
                durable.due.append(seq)
                self._pump(durable)

        durable.timers[seq] = asyncio.get_running_loop().call_later(delay_s, again)

    def _acked(self, subject: str, data: bytes) -> None:
        tokens = subject.split(".")
        durable = self.durables.get(tokens[3])
        if durable is None:
            return  # an ordered replay's: nothing to settle
        seq = int(tokens[5])
        if data.startswith(b"-NAK"):
            delay_ns = orjson.loads(data[4:]).get("delay", 0) if data[4:].strip() else 0
            self._redeliver_after(durable, seq, delay_ns / 1e9)
            return
        if data.startswith(b"+WPI"):
            self._redeliver_after(durable, seq, durable.config.ack_wait or 30.0)
            return
        durable.unacked.pop(seq, None)
        timer = durable.timers.pop(seq, None)
        if timer is not None:
            timer.cancel()

    # -- ordered replay -------------------------------------------------------------------

    def replay(
        self, client: MemoryClient, stream: str, subject: str, start: int, cb: Callback
    ) -> _Subscription:
        """``cb`` on each message of ``stream`` on ``subject`` from sequence ``start`` on, then
        on each stored later, in order."""
        store = self.streams[stream]
        sub = _Subscription(client, f"_replay.{stream}", "", cb)
        position = start - 1

        def follow() -> None:
            nonlocal position
            for seq in sorted(s for s in store.messages if s > position):
                position = seq
                stored = store.messages[seq]
                if matches(subject, stored.subject):
                    reply = f"{_ACK_PREFIX}{stream}.ordered.1.{seq}.{seq}.{time.time_ns()}.0"
                    sub.put(stored.subject, reply, stored.data, stored.headers)

        follow()
        self._replays.append((sub, follow))
        return sub


class MemoryClient:
    """What :class:`bus.client.Bus` and :class:`bus.confirms.Confirmations` use of nats-py's
    client, on a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        self.broker, self.name = broker, name
        self.is_connected, self.is_closed = True, False
        self.max_payload = _MAX_PAYLOAD
        self.stats = {"reconnects": 0}
        self._subs: list[_Subscription] = []

    def jetstream(self) -> MemoryJetStream:
        return MemoryJetStream(self)

    def new_inbox(self) -> str:
        return self.broker.new_inbox()

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if len(payload) > self.max_payload:
            raise nats.errors.MaxPayloadError
        self.broker.publish(self, subject, payload, reply, headers)

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callback | None = None
    ) -> _Subscription:
        assert cb is not None, "the bus always subscribes with a callback"
        sub = self.broker.subscribe(self, subject, queue, cb)
        self._subs.append(sub)
        return sub

    async def request(
        self, subject: str, payload: bytes = b"", timeout: float = 0.5, headers: Any = None
    ) -> Msg:
        inbox = self.new_inbox()
        answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

        async def on_answer(msg: Msg) -> None:
            if not answer.done():
                answer.set_result(msg)

        sub = await self.subscribe(inbox, cb=on_answer)
        try:
            await self.publish(subject, payload, reply=inbox, headers=headers)
            try:
                msg = await asyncio.wait_for(answer, timeout)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            await sub.unsubscribe()
        if msg.headers and msg.headers.get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg

    async def flush(self, timeout: float = 2.0) -> None:
        """Whatever was published has been handed to its subscriptions already."""

    async def _send_ping(self, pong: asyncio.Future[bool]) -> None:
        """Answered once this connection's subscriptions have taken what came before it."""
        for sub in list(self._subs):
            await sub.settled()
        if not pong.done():
            pong.set_result(True)

    async def drain(self) -> None:
        for sub in list(self._subs):
            await sub.settled()
        await self.close()

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        self.is_connected, self.is_closed = False, True


class MemoryJetStream:
    """What the bus asks of nats-py's JetStream context: the streams' settings (only read:
    the broker has the topology's), durables made, and ordered replay."""

    def __init__(self, client: MemoryClient) -> None:
        self._client = client
        self._broker = client.broker

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> StreamInfo:
        stream = self._broker.streams.get(name)
        if stream is None:
            raise NotFoundError
        counts: dict[str, int] = {}
        for stored in stream.messages.values():
            if subjects_filter is not None and matches(subjects_filter, stored.subject):
                counts[stored.subject] = counts.get(stored.subject, 0) + 1
        state = StreamState(
            messages=len(stream.messages),
            bytes=sum(len(m.data) for m in stream.messages.values()),
            first_seq=min(stream.messages, default=stream.last_seq + 1),
            last_seq=stream.last_seq,
            consumer_count=sum(d.stream == name for d in self._broker.durables.values()),
            subjects=counts if subjects_filter is not None else None,
        )
        return StreamInfo(config=stream.config, state=state)

    async def add_stream(self, config: StreamConfig) -> None:
        assert config.name is not None
        self._broker.streams.setdefault(config.name, _Stream(config))

    async def delete_stream(self, name: str) -> None:
        if self._broker.streams.pop(name, None) is None:
            raise NotFoundError

    async def find_stream_name_by_subject(self, subject: str) -> str:
        for name, stream in self._broker.streams.items():
            if stream.takes(subject):
                return name
        raise NotFoundError

    async def publish(
        self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None
    ) -> PubAck:
        """JetStream's publish: the stream's answer, or none when no stream takes ``subject``."""
        try:
            answer = await self._client.request(subject, payload, headers=headers)
        except nats.errors.NoRespondersError:
            raise NoStreamResponseError from None
        ack = orjson.loads(answer.data)
        return PubAck(stream=ack["stream"], seq=ack["seq"], duplicate=ack.get("duplicate"))

    async def get_last_msg(self, stream: str, subject: str) -> RawStreamMsg:
        messages = self._broker.streams[stream].messages
        last = max((s for s, m in messages.items() if m.subject == subject), default=None)
        if last is None:
            raise NotFoundError
        found = messages[last]
        return RawStreamMsg(
            subject=found.subject, seq=found.seq, data=found.data, headers=found.headers
        )

    async def update_stream(self, config: StreamConfig) -> None:
        assert config.name is not None
        self._broker.streams[config.name].config = config

    async def add_consumer(self, stream: str, config: ConsumerConfig) -> None:
        self._broker.add_durable(stream, config)

    async def consumer_info(self, stream: str, durable: str) -> ConsumerInfo:
        found = self._broker.durables.get(durable)
        if found is None or found.stream != stream:
            raise NotFoundError
        filtered = found.config.filter_subject or ">"
        pending = sum(
            1
            for seq, stored in self._broker.streams[stream].messages.items()
            if seq > found.delivered and matches(filtered, stored.subject)
        )
        return ConsumerInfo(
            name=durable,
            stream_name=stream,
            config=found.config,
            created=found.created,
            num_ack_pending=len(found.unacked),
            num_pending=pending,
        )

    async def subscribe(
        self,
        subject: str,
        *,
        stream: str,
        cb: Callback,
        ordered_consumer: bool,
        deliver_policy: Any,
        config: ConsumerConfig,
    ) -> _Subscription:
        assert ordered_consumer, "the bus replays with ordered consumers only"
        sub = self._broker.replay(self._client, stream, subject, config.opt_start_seq or 1, cb)
        self._client._subs.append(sub)
        return sub
