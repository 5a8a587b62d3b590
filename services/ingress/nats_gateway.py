"""The live Gateway: requests out as RequestAccepted, answers back from this instance's subjects
(the planner's placements, the workers' tokens and terminals); a lost batch is asked of the
request's worker again (``lw.resend.<worker>``) and a request whose worker went moves on
(:mod:`services.ingress.follow`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError
from opentelemetry import trace

from bus.client import Bus
from bus.received import received
from bus.topology import PLANNER_INTAKE, TOKEN_DELTAS, Subjects
from observability.tracing import trace_context
from schemas.codec import encode
from schemas.deltas import Batch, lean_batch
from schemas.events import (
    CancellationRequested,
    RequestAccepted,
    RequestFailed,
    RequestSpec,
    TokensGenerated,
)
from schemas.messages import ResendQuery, ResendReply
from services.ingress.follow import Follow, Heard, Recovery
from services.ingress.gateway import CancelReason, GatewayEvent
from services.ingress.loop_lag import LoopLag
from services.ingress.mailbox import Mailbox
from services.ingress.migration import avoiding

# A worker a stream moved off is avoided by the next requests this long: a worker behind a
# congested link is heard late, then not at all, then in a burst as its routes close and open
# again, so the planner placed attempts moved off one worker there on its neighbour (the
# three-hosts suite, docs/operations.md).
SHUN_S = 10.0


class NatsGateway:
    def __init__(
        self,
        bus: Bus,
        instance_id: str,
        recovery: Recovery | None = None,
        late: Callable[[str], bool] | None = None,
        unheard: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``late``: whether a worker's load reports come late (``Liveness.late``): its streams
        move on as soon as they fall silent. ``unheard``: the workers heard late or not at all
        (``Liveness.quiet``), which every attempt asks the planner to avoid."""
        self._bus = bus
        self._late = late
        self._unheard = unheard or frozenset
        # Workers streams moved off, and until when the next requests avoid them.
        self._shunned: dict[str, float] = {}
        self._recovery = recovery or Recovery()
        self._instance_id = instance_id
        self._source = f"ingress/{instance_id}"
        self._streams: dict[str, Mailbox] = {}
        self._tracer = trace.get_tracer("laneway.ingress")
        self._lag: LoopLag | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._tokens = Subjects.tokens(instance_id)

    def behind(self) -> bool:
        """This ingress's event loop runs late: it takes in and writes out its streams' tokens
        late (admission takes no new request meanwhile)."""
        return self._lag is not None and self._lag.behind()

    async def start(self, on_tick: Callable[[float], None] | None = None) -> None:
        """``on_tick``: hears how late each tick of the loop-lag clock came (seconds)."""
        self._lag = LoopLag(on_tick=on_tick)
        self._lag_task = asyncio.create_task(self._lag.run(), name="loop-lag")
        # Core subscriptions on this instance's own subjects: set up once, lowest latency.
        await self._bus.subscribe(Subjects.placements(self._instance_id), self._deliver)
        await self._bus.subscribe(Subjects.planner_failures(self._instance_id), self._deliver)
        await self._bus.subscribe_bytes(self._tokens.subject, self._deliver_tokens)
        await self._bus.subscribe(Subjects.request_terminal(self._instance_id), self._deliver)

    async def _deliver(self, event: Heard) -> None:
        queue = self._streams.get(event.request_id or "")
        if queue is not None:
            queue.put_nowait(event)

    async def _deliver_tokens(self, msg: Msg) -> None:
        """A step's batch goes to each of its requests still followed here (a request that
        ended meanwhile takes nothing). Read lean when it is a batch from the worker its subject
        names (what only that worker may publish to); anything else the bus's way, checked and
        logged as on every subscription."""
        batch: Batch | None = lean_batch(msg.data)
        if batch is None or batch.worker_id != TOKEN_DELTAS.key_of(msg.subject):
            event = received(self._tokens, msg.data, msg.subject)
            if isinstance(event, TokensGenerated):
                await self._deliver(event)
                return
            batch = event
        if batch is None:
            return
        streams = self._streams
        for run in batch.runs:
            queue = streams.get(run.request_id)
            if queue is not None:
                queue.put_run(batch, run)

    async def submit(
        self, request_id: str, session_id: str | None, spec: RequestSpec
    ) -> AsyncIterator[GatewayEvent]:
        queue = Mailbox()
        self._streams[request_id] = queue
        with self._tracer.start_as_current_span("ingress.request") as span:
            span.set_attribute("laneway.request_id", request_id)
            span.set_attribute("laneway.prompt_tokens", len(spec.prompt_token_ids))
            try:
                accepted = RequestAccepted(
                    source=self._source,
                    request_id=request_id,
                    session_id=session_id,
                    trace=trace_context(span),
                    spec=avoiding(spec, self._avoided()),
                )
                try:
                    await self._bus.publish(Subjects.request_accepted, accepted)
                except MaxPayloadError:
                    # The engine could hold it, the bus cannot carry it: the client's to fix.
                    yield self._too_large(accepted)
                    return
                follow = Follow(
                    accepted,
                    queue,
                    self._recovery,
                    self.ask,
                    lambda moved: self._bus.publish(Subjects.request_accepted, self._avoid(moved)),
                    self._source,
                    hold=self._lag.hold_s if self._lag is not None else None,
                    drain=self.drain,
                    unplaced=self._intake_late,
                    late=self._late,
                )
                # Closed here, not left to the loop's finalizer of abandoned generators: the
                # client's answer ends at the terminal, with the generator still suspended,
                # and the finalizer would close it in a task of its own, one per request.
                async with contextlib.aclosing(follow.events()) as events:
                    async for event in events:
                        yield event
                if follow.ended is not None:
                    span.set_attribute("laneway.outcome", follow.ended.type)
                span.set_attribute("laneway.attempts", follow.attempt + 1)
            finally:
                del self._streams[request_id]

    def _avoid(self, moved: RequestAccepted) -> RequestAccepted:
        """``moved`` (an attempt after the first) avoiding what new requests do; the workers
        it left are shunned for ``SHUN_S``."""
        until = time.monotonic() + SHUN_S
        for worker in moved.spec.avoid_workers:
            self._shunned[worker] = until
        spec = avoiding(moved.spec, self._avoided())
        return moved if spec is moved.spec else moved.model_copy(update={"spec": spec})

    def _avoided(self) -> Collection[str]:
        unheard = self._unheard()
        if not self._shunned:
            return unheard
        now = time.monotonic()
        self._shunned = {w: until for w, until in self._shunned.items() if until > now}
        return {*unheard, *self._shunned}

    def _intake_late(self) -> None:
        """A request in the stream has had no placement for ``Recovery.unplaced_s``: the
        planners' durable may be led from a server behind a slow link (bus.leaders)."""
        self._bus.undelivered(PLANNER_INTAKE)

    async def ask(
        self, request_id: str, worker_id: str, index: int, attempt: int
    ) -> ResendReply | None:
        """``worker_id``'s kept events of ``attempt`` of ``request_id`` from token ``index`` on;
        None when it does not hold it (or does not answer in time)."""
        try:
            return await self._bus.request(
                Subjects.resend(worker_id),
                ResendQuery(request_id=request_id, index=index, attempt=attempt),
                timeout=min(self._recovery.silence_s, 0.5),
            )
        except (NatsError, TimeoutError):
            return None

    async def drain(self) -> None:
        """Returns once what was on its way to this ingress when called has come in: the server
        answers a ping after everything it sent this connection before, and the subscriptions
        take what came in that order (a worker's tokens before its later terminal). At most
        ``Recovery.drain_s``, and at once while the connection is down."""
        nc = self._bus.nc
        if not nc.is_connected:
            return
        # A future of our own in nats-py's queue of pings, never cancelled: flush() cancels its
        # own on a timeout or when its caller is (a client gone), and the pong that comes later
        # then fails nats-py's read loop (InvalidStateError), which stops the whole ingress
        # hearing the bus. Left unanswered (a reconnect forgets it), it is just dropped.
        pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await nc._send_ping(pong)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pong), self._recovery.drain_s)

    def _too_large(self, accepted: RequestAccepted) -> RequestFailed:
        limit = self._bus.nc.max_payload
        return RequestFailed(
            source=self._source,
            request_id=accepted.request_id,
            session_id=accepted.session_id,
            code="invalid_request",
            message=f"the request is {len(encode(accepted)):,} bytes as an event, more than the "
            f"message bus carries ({limit:,}): send a shorter prompt",
        )

    async def cancel(self, request_id: str, reason: CancelReason) -> None:
        await self._bus.publish(
            Subjects.cancellation_requested,
            CancellationRequested(source=self._source, request_id=request_id, reason=reason),
        )
