"""nats-py's client and JetStream context, as :class:`bus.client.Bus` and
:class:`bus.confirms.Confirmations` use them, on a :class:`bus.memory.MemoryBroker` (see there
for what it keeps of a server and what it leaves out)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

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

from bus.channels import matches
from bus.memory_parts import Callback, Stream, Subscription

if TYPE_CHECKING:
    from bus.memory import MemoryBroker

# What nats-server allows by default, and `laneway up` sets.
_MAX_PAYLOAD = 8 * 1024 * 1024


class MemoryClient:
    """What :class:`bus.client.Bus` and :class:`bus.confirms.Confirmations` use of nats-py's
    client, on a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker, name: str) -> None:
        self.broker, self.name = broker, name
        self.is_connected, self.is_closed = True, False
        self.max_payload = _MAX_PAYLOAD
        self.stats = {"reconnects": 0}
        self._subs: list[Subscription] = []

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
    ) -> Subscription:
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
        self._broker.streams.setdefault(config.name, Stream(config))

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

    async def object_store(self, bucket: str) -> Any:
        """The broker has no object store: every bucket is missing, as on a server where nobody
        made it (a fold then starts from the stream's beginning, a snapshot is refused)."""
        raise NotFoundError

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
    ) -> Subscription:
        assert ordered_consumer, "the bus replays with ordered consumers only"
        sub = self._broker.replay(self._client, stream, subject, config.opt_start_seq or 1, cb)
        self._client._subs.append(sub)
        return sub
