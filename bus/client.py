"""One connection per process; typed publish, subscribe, consume and request/reply over it."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.aio.client
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from opentelemetry import context as otel_context
from pydantic import BaseModel, ValidationError

from bus.channels import Asked, Consumer, Topic
from bus.confirms import Confirmations
from bus.credentials import is_inbox, nats_options
from bus.leaders import LeaderSteward
from bus.provision import ensure_consumer, ensure_streams
from bus.received import drops, for_handler, received, undecodable
from observability.drops import first_line
from observability.tracing import context_of_headers, trace_headers
from schemas.codec import decode_as, decode_event, encode
from schemas.events import Envelope

log = logging.getLogger(__name__)

# nats-py reads its socket through an asyncio StreamReader limited to this, which stops taking
# from the socket past twice it: at its 32 KiB an ingress busy with 2,000 streams took in less
# per turn of its loop than the workers' token batches brought, until the server dropped it as
# a slow consumer (its 10 s write deadline passed).
nats.aio.client.DEFAULT_BUFFER_SIZE = 1 << 20

E = TypeVar("E", bound=Envelope)
Q = TypeVar("Q", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)

MSG_ID_HEADER = "Nats-Msg-Id"
# What a JetStream delivery's reply subject begins with: where its acknowledgement goes.
_ACKS = "$JS.ACK."
# How long closing waits for handlers still running in tasks; those left are redelivered.
CLOSE_HANDLERS_WITHIN_S = 5.0


def event_headers(event: Envelope, stored: bool = True) -> dict[str, str]:
    # The message id makes JetStream drop a re-published duplicate within the window; the trace
    # headers let tools that only read headers follow the trace without decoding the body.
    # Nothing drops a core message's copy, so it carries no id (headers cost nats-py ~4 us a
    # message, sent and received: a step's token batches have none at all).
    headers = {MSG_ID_HEADER: event.event_id} if stored else {}
    if event.trace is not None:
        headers["traceparent"] = event.trace.traceparent
        if event.trace.tracestate:
            headers["tracestate"] = event.trace.tracestate
    return headers


async def at_server(nc: NatsClient) -> None:
    """Returns once the server has read everything sent on ``nc`` so far (its subscriptions
    included). nats-py's ``flush`` writes its PING at once, ahead of commands still queued for
    its flusher task, so its PONG can come back before the server has read a SUB or PUB made
    just before it; by then the flusher has written them, and a second PING goes after them."""
    await nc.flush()
    await nc.flush()


async def _log_error(error: Exception) -> None:
    # A permission refused is the server's only answer to a publish or subscription it does not
    # allow (the publisher's request then times out): say which.
    log.warning("nats: %s", error)


class Bus:
    def __init__(
        self,
        nc: NatsClient,
        steps_down: tuple[str, ...] = (),
        durables_step_down: tuple[Consumer[Any], ...] = (),
    ) -> None:
        """``steps_down``: the streams whose leader this connection asks to step down when a
        confirmed publish to it goes unanswered; ``durables_step_down``, the durables whose
        leader it asks when told their deliveries are late (:meth:`undelivered`; bus.leaders)."""
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._steward = LeaderSteward(nc, steps_down, durables_step_down)
        self._confirms = Confirmations(nc, self._steward.unanswered)
        self._subs: list[Subscription] = []
        # Whether the admin made the streams and durables (see ``provision``).
        self._by_admin = False
        # Handlers of consumed messages running in tasks of their own (``consume``'s
        # concurrency): each acks its message, so closing waits for them.
        self._handling: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        tls: ssl.SSLContext | None = None,
        steps_down: tuple[str, ...] = (),
        durables_step_down: tuple[Consumer[Any], ...] = (),
    ) -> Bus:
        """``url`` may list several servers of one cluster, comma-separated: the connection
        moves to another (those listed, or those the cluster tells of) when its server goes.

        Credentials as ``bus.credentials.nats_login`` finds them; TLS from ``tls`` or else the
        ``LANEWAY_NATS_TLS_*`` settings (see :mod:`bus.tls`)."""
        options = nats_options(url)
        if tls is not None:
            options["tls"] = tls
        nc = await nats.connect(
            name=name,
            error_cb=_log_error,
            **options,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            # A server that is up but silent (partitioned, frozen) is left after about 6 s of
            # unanswered pings, not nats-py's default 4 minutes.
            ping_interval=2,
            max_outstanding_pings=3,
        )
        return cls(nc, steps_down, durables_step_down)

    def undelivered(self, consumer: Consumer[Any]) -> None:
        """What ``consumer`` should have delivered by now has not come: its leader is asked to
        step down if this connection was given it (``durables_step_down``)."""
        self._steward.undelivered(consumer)

    def asks_unless(self, behind: Callable[[], bool]) -> None:
        """No leader is asked to step down while ``behind()``: this process's own link is the
        slow one (it hears every worker late, ``Liveness.behind``; a planner, its requests)."""
        self._steward.behind = behind

    @property
    def nc(self) -> NatsClient:
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        return self._js

    @property
    def reconnects(self) -> int:
        """Times the connection was made again: what was sent before one may not have gone."""
        return int(self._nc.stats["reconnects"])

    async def provision(self, replicas: int, by_admin: bool) -> None:
        """What a service needs of the bus's state (streams, the object store's bucket, its
        durable). ``by_admin``: the admin made it all (``laneway up`` with bus auth), as the
        services' own NATS users may not; else each service makes what is missing, so that
        start order is free on an open server."""
        self._by_admin = by_admin
        if not by_admin:
            await ensure_streams(self._js, replicas)

    async def publish(self, topic: Topic[E], event: E) -> None:
        """Publish an event the way its channel declares: ``confirmed`` returns once the stream
        stored it; ``stored`` and ``core`` return once the connection has it (one connection
        keeps a publisher's order)."""
        delivery = topic.delivery
        if delivery == "confirmed":
            data, headers = self._confirmed(topic, event)
            sent = await self._confirms.send(topic.subject, data, headers)
            await self._confirms.stored(topic.subject, data, headers, sent)
        else:
            headers = event_headers(event, stored=delivery == "stored")
            await self._nc.publish(topic.subject, encode(event), headers=headers or None)

    async def send_confirmed(
        self, topic: Topic[E], event: E, retry: Callable[[Coroutine[Any, Any, None]], object]
    ) -> None:
        """Publish an event of a confirmed channel now, behind what went before on the
        connection (so it goes out in one write with what is published next, before the loop
        turns), without waiting for its stream's confirmation: that is checked when it comes. A
        publish the stream did not confirm at once is tried again, or its error raised, in the
        coroutine handed to ``retry`` to run (in a task of the publisher's)."""
        data, headers = self._confirmed(topic, event)
        sent = await self._confirms.send(topic.subject, data, headers)
        self._confirms.settle(topic.subject, data, headers, sent, retry)

    def _confirmed(self, topic: Topic[E], event: E) -> tuple[bytes, dict[str, str]]:
        if topic.delivery != "confirmed":
            raise ValueError(f"{topic.subject} is not a confirmed channel")
        return encode(event), event_headers(event)

    async def publish_bytes(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Core NATS, no stream: bulk data that is not an event (see :mod:`bus.blobs`)."""
        await self._nc.publish(subject, data, headers=headers)

    async def subscribe_bytes(
        self, subject: str, handler: Callable[[Msg], Awaitable[None]]
    ) -> None:
        self._subs.append(await self._nc.subscribe(subject, cb=handler))

    async def subscribe(self, topic: Topic[E], handler: Callable[[E], Awaitable[None]]) -> None:
        """Core (non-durable) subscription: lowest latency, for live views of a stream."""

        async def on_msg(msg: Msg) -> None:
            typed = received(topic, msg.data, msg.subject)
            if typed is not None:
                await handler(typed)

        self._subs.append(await self._nc.subscribe(topic.subject, cb=on_msg))

    async def consume(
        self,
        consumer: Consumer[E],
        handler: Callable[[E], Awaitable[None]],
        concurrency: int = 1,
    ) -> Subscription:
        """Durable consumer with explicit ack: a message is acked only after its handler
        returned, re-delivered if the handler failed. Handlers must therefore be idempotent.
        A message the handler does not take is acked unhandled, so it cannot hold the
        consumer up.

        ``concurrency``: how many messages' handlers may run at once, each in a task of its
        own, started in delivery order (1: one after the other). A handler that waits on round
        trips (the planner's) then no longer holds every message behind it.

        The durable is made here unless the admin made it (``provision``); either way it is
        bound to by subscribing to its deliver subject, which needs no JetStream API call."""
        if not self._by_admin:
            await ensure_consumer(self._js, consumer)

        async def on_msg(msg: Msg) -> None:
            if not msg.reply.startswith(_ACKS):
                # Not the durable's delivery: a status or heartbeat from a consumer someone else
                # pointed here, or a message published to the subject.
                drops("not_a_delivery", "dropping a message on %s: no delivery", msg.subject)
                return
            try:
                event = decode_event(msg.data)
            except (ValidationError, ValueError) as error:
                undecodable(msg.subject, error, "terminating")
                await msg.term()
                return
            typed = for_handler(consumer.topic, event, msg.subject)
            if typed is None:
                await msg.ack()
                return
            try:
                await handler(typed)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler failed for %s; asking for redelivery", event.type)
                await msg.nak(delay=1.0)
                return
            await msg.ack()

        sub = await self._nc.subscribe(
            consumer.deliver_subject,
            queue=consumer.queue or "",
            cb=on_msg if concurrency == 1 else self._in_tasks(on_msg, concurrency),
        )
        self._subs.append(sub)
        return sub

    async def leads_here(self, consumer: Consumer[Any], timeout_s: float = 2.0) -> bool:
        """Whether ``consumer``'s leader is the server this connection is on; False where that
        cannot be told within ``timeout_s``."""
        try:
            info = await asyncio.wait_for(
                self._js.consumer_info(consumer.stream.name, consumer.durable), timeout_s
            )
        except (TimeoutError, nats.errors.Error):
            return False
        leader = info.cluster.leader if info.cluster is not None else None
        # The INFO the server sent on connecting names it (nats-py keeps it, unexposed).
        return leader is not None and leader == self._nc._server_info.get("server_name")

    async def leave(self, sub: Subscription) -> None:
        """Stop taking deliveries on ``sub`` (of :meth:`consume`): those it holds are handled
        first, so none waits for its redelivery."""
        self._subs.remove(sub)
        await sub.drain()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped

    def _in_tasks(
        self, on_msg: Callable[[Msg], Coroutine[Any, Any, None]], limit: int
    ) -> Callable[[Msg], Awaitable[None]]:
        """``on_msg`` run in a task per message, at most ``limit`` at once: the subscription
        waits for a free slot, so the messages beyond wait in the client as they would for a
        handler running inline."""
        slots = asyncio.Semaphore(limit)

        def done(task: asyncio.Task[None]) -> None:
            self._handling.discard(task)
            slots.release()

        async def dispatch(msg: Msg) -> None:
            await slots.acquire()
            task = asyncio.create_task(on_msg(msg))
            self._handling.add(task)
            task.add_done_callback(done)

        return dispatch

    async def replay(
        self, topic: Topic[E], after: int, handler: Callable[[E, int], Awaitable[None]]
    ) -> None:
        """Every event on ``topic`` past stream position ``after``, in order, then live ones;
        the handler gets each with its position (sequence number) in the stream.

        For state rebuilt as a fold: the caller remembers the last position it folded (in a
        snapshot) and resumes after it. An ordered consumer needs no acks and no durable name.
        """
        stream = topic.stream
        if stream is None:
            raise ValueError(f"{topic.subject} is in no stream: nothing to replay")

        async def on_msg(msg: Msg) -> None:
            try:
                event = decode_event(msg.data)
            except (ValidationError, ValueError) as error:
                undecodable(msg.subject, error, "skipping")
                return
            typed = for_handler(topic, event, msg.subject)
            if typed is not None:
                await handler(typed, msg.metadata.sequence.stream)

        sub = await self._js.subscribe(
            topic.subject,
            stream=stream.name,
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            config=ConsumerConfig(opt_start_seq=after + 1),
        )
        self._subs.append(sub)

    async def request(self, asked: Asked[Q, R], query: Q, timeout: float) -> R:
        """Ask and wait for the answer; the active span's trace goes along in the headers."""
        msg = await self._nc.request(
            asked.subject, encode(query), timeout=timeout, headers=trace_headers() or None
        )
        return decode_as(asked.reply, msg.data)

    async def serve(
        self, asked: Asked[Q, R], handler: Callable[[Q], Awaitable[R]], *, queue: str
    ) -> None:
        """Answer requests on ``asked``'s subject; replicas in one queue group share the load. The
        handler runs in the trace of the asker (its headers), so its spans join that trace."""

        async def on_msg(msg: Msg) -> None:
            if not is_inbox(msg.reply):
                drops(
                    "not_an_inbox",
                    "no answer on %s to %.80r: not an inbox",
                    asked.subject,
                    msg.reply,
                )
                return
            token = otel_context.attach(context_of_headers(msg.headers))
            try:
                answer = await handler(decode_as(asked.query, msg.data))
            except ValidationError as error:
                drops("malformed_query", "bad query on %s: %s", asked.subject, first_line(error))
                return
            finally:
                otel_context.detach(token)
            await msg.respond(encode(answer))

        self._subs.append(await self._nc.subscribe(asked.subject, queue=queue, cb=on_msg))

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be gone; closing anyway
                log.debug("unsubscribe failed", exc_info=True)
        self._subs.clear()
        if self._handling:
            await asyncio.wait(self._handling, timeout=CLOSE_HANDLERS_WITHIN_S)
        if self._nc.is_connected:
            await self._nc.drain()
        elif not self._nc.is_closed:
            # No server to drain to (it went, or is going, with us): waiting for a reconnect
            # would only hold the process past its shutdown.
            await self._nc.close()
