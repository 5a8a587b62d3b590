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
import itertools
import time
from collections.abc import Callable
from typing import Any

import orjson
from nats.js.api import (
    ConsumerConfig,
)

from bus.channels import matches
from bus.client import Bus
from bus.memory_client import MemoryClient
from bus.memory_parts import Callback, Durable, Stream, Subscription
from bus.topology import STREAM_SUBJECTS

_ACK_PREFIX = "$JS.ACK."
# A publisher's condition that the message land in this stream: refused otherwise.
_EXPECTED_STREAM = "Nats-Expected-Stream"


class MemoryBroker:
    """The server: the topology's streams, every connection's subscriptions, the durables."""

    def __init__(self) -> None:
        self.streams = {
            s.name: Stream(s.config(list(subjects))) for s, subjects in STREAM_SUBJECTS.items()
        }
        self.subs: list[Subscription] = []
        self.durables: dict[str, Durable] = {}
        self._turns = itertools.count()
        self._inboxes = itertools.count()
        self.callback_errors = 0
        # Each ordered replay, and what brings it up to its stream's newest message.
        self._replays: list[tuple[Subscription, Callable[[], None]]] = []

    def connect(self, name: str = "memory") -> Bus:
        """A connection of its own, as ``Bus.connect`` makes one; the streams and durables are
        the broker's, so that services on connections of one broker meet."""
        return Bus(MemoryClient(self, name))  # type: ignore[arg-type]

    def new_inbox(self) -> str:
        return f"_INBOX.memory.{next(self._inboxes)}"

    def drop(self, sub: Subscription) -> None:
        if sub in self.subs:
            self.subs.remove(sub)
        self._replays = [(r, follow) for r, follow in self._replays if r is not sub]

    def subscribe(
        self, client: MemoryClient, subject: str, queue: str, cb: Callback
    ) -> Subscription:
        sub = Subscription(client, subject, queue, cb)
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
        groups: dict[str, list[Subscription]] = {}
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
            self.durables[config.durable_name] = Durable(stream, config)
        else:
            found.config = config

    def _pump(self, durable: Durable) -> None:
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
            reply = _ack_subject(durable.stream, config.durable_name or "", times, seq)
            member = members[next(self._turns) % len(members)]
            member.put(stored.subject, reply, stored.data, stored.headers)
            self._redeliver_after(durable, seq, durable.ack_wait_s)
        durable.due.clear()

    def _redeliver_after(self, durable: Durable, seq: int, delay_s: float) -> None:
        durable.stop_timer(seq)

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
            self._redeliver_after(durable, seq, durable.ack_wait_s)
            return
        durable.unacked.pop(seq, None)
        durable.stop_timer(seq)

    # -- ordered replay -------------------------------------------------------------------

    def replay(
        self, client: MemoryClient, stream: str, subject: str, start: int, cb: Callback
    ) -> Subscription:
        """``cb`` on each message of ``stream`` on ``subject`` from sequence ``start`` on, then
        on each stored later, in order."""
        store = self.streams[stream]
        sub = Subscription(client, f"_replay.{stream}", "", cb)
        position = start - 1

        def follow() -> None:
            nonlocal position
            for seq in sorted(s for s in store.messages if s > position):
                position = seq
                stored = store.messages[seq]
                if matches(subject, stored.subject):
                    reply = _ack_subject(stream, "ordered", 1, seq)
                    sub.put(stored.subject, reply, stored.data, stored.headers)

        follow()
        self._replays.append((sub, follow))
        return sub


def _ack_subject(stream: str, consumer: str, times: int, seq: int) -> str:
    """A delivery's reply subject, as JetStream's (nats-py reads its metadata from it): stream,
    consumer, times delivered, stream and consumer sequence, time, pending."""
    return f"{_ACK_PREFIX}{stream}.{consumer}.{times}.{seq}.{seq}.{time.time_ns()}.0"
