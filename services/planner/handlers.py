"""The planner's subscribers: thin adapters between events and the policy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.subscription import Subscription
from opentelemetry import trace

from bus.client import Bus
from bus.sessions import SessionRefused, SessionStore, session_key
from bus.topology import PLANNER_INTAKE, Subjects
from observability.tracing import context_of, trace_context
from schemas.events import (
    FailureCode,
    RequestAccepted,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    RouteDecided,
    TerminalEvent,
    WorkerLoadReported,
    utc_now,
)
from schemas.messages import WorkerRegistration
from services.common.kv_follow import KvFollower
from services.planner.cluster import ClusterView, Routed, migrated_reason
from services.planner.decision import Decision, DecisionInputs, decide, rebind
from services.planner.disagg import DisaggSettings
from services.planner.intake_gate import HOLD_S, IntakeGate
from services.planner.intake_turn import IntakeTurn
from services.planner.metrics import PlannerMetrics
from services.planner.output_length import OutputLengthPredictor
from services.planner.overlaps import OverlapAsker, Overlaps
from services.planner.policy import Policy, RouteRequest

log = logging.getLogger(__name__)

# Requests routed at once. Each waits on round trips (the overlap query, its route's and
# placement's confirmations); one at a time, each waited for the one before it. A decision
# itself is made without a pause (but for a session binding's round trip to etcd) on the state
# the requests routed before it left.
ROUTING_CONCURRENCY = 64
# How often a replica weighs leaving the shared intake, or taking it again.
GATE_EVERY_S = 0.25


class Planner:
    def __init__(
        self,
        bus: Bus,
        policy: Policy,
        instance_id: str,
        overlap_timeout_s: float = 0.05,
        sessions: SessionStore | None = None,
        no_worker_grace_s: float = 2.0,
        disagg: DisaggSettings | None = None,
        lengths: OutputLengthPredictor | None = None,
        follower: KvFollower | None = None,
    ) -> None:
        """``lengths``: learns the output length the cost model assumes from finished requests;
        None, it assumes each request's max_tokens. ``follower``: the planner's own fold of the
        KV stream, which answers overlaps while it has caught up; None, the kv-indexer does."""
        self._bus = bus
        self._lengths = lengths
        self._disagg = disagg or DisaggSettings(mode="never")
        self._no_worker_grace_s = no_worker_grace_s
        self._workers_changed = asyncio.Event()
        self._policy = policy
        self._sessions = sessions
        self._source = f"planner/{instance_id}"
        self.cluster = ClusterView()
        self.intake = IntakeGate()
        self._intake: Subscription | None = None
        # Requests (id, attempt) being routed now: consumed up to ROUTING_CONCURRENCY at once.
        self._routing: dict[tuple[str, int], asyncio.Event] = {}
        self.metrics = PlannerMetrics(self.cluster)
        asker = OverlapAsker(
            bus, overlap_timeout_s, self.metrics.overlap_seconds, self.metrics.overlap_failures
        )
        self._overlaps = Overlaps(asker, follower, self.metrics.overlap_answers)
        self._tracer = trace.get_tracer("laneway.planner")

    async def attach(self, on_finished: Callable[[RequestFinished], None] | None = None) -> None:
        """Take requests, terminal events and load reports from the bus; ``on_finished`` also
        hears every finished request (the capacity loop)."""

        async def on_terminal(event: TerminalEvent) -> None:
            await self.on_terminal(event)
            if on_finished is not None and isinstance(event, RequestFinished):
                on_finished(event)

        await self._bus.subscribe(Subjects.worker_terminals, on_terminal)
        await self._bus.subscribe(Subjects.all_load, self.on_load)
        await self._take_requests()

    async def _take_requests(self) -> None:
        self._intake = await self._bus.consume(
            PLANNER_INTAKE, self.on_request, concurrency=ROUTING_CONCURRENCY
        )

    async def keep_intake(self, turn: IntakeTurn) -> None:
        """Leave the intake to the other replicas while requests come here late, when it is
        this replica's turn (``turn``), and take it again (:class:`IntakeGate`); forever."""
        while True:
            await asyncio.sleep(GATE_EVERY_S)
            if self._intake is None:
                continue
            if self.intake.taking and self.intake.late():
                # Led from this replica's own server, the intake's lateness is upstream of it
                # (the requests' stream led from a slow host): every replica's requests come
                # late, and one of them must keep taking them.
                if await self._bus.leads_here(PLANNER_INTAKE) or not await turn.take():
                    await asyncio.sleep(HOLD_S)  # each look costs round trips
                    continue
                log.warning(
                    "%s: requests come late here; leaving them to the other replicas for %.0f s",
                    self._source,
                    HOLD_S,
                )
                self.intake.leave()
                self.metrics.intake_left.inc()
                await self._bus.leave(self._intake)
            elif self.intake.back():
                log.warning("%s: taking requests again", self._source)
                await self._take_requests()
                await turn.give_back()

    async def on_request(self, event: RequestAccepted) -> None:
        if event.request_id is None:
            return
        if event.spec.attempt == 0:  # a later attempt's was accepted when the first was
            self.intake.heard(event.source, event.occurred_at.timestamp())
        key = (event.request_id, event.spec.attempt)
        while (earlier := self._routing.get(key)) is not None:
            # A redelivery while its first delivery is still routing: it waits for that one,
            # which may yet fail (and then this one routes it).
            await earlier.wait()
        if self.cluster.is_routed(event.request_id, event.spec.attempt):  # a redelivery
            return
        self._routing[key] = routing = asyncio.Event()
        try:
            await self._on_request(event)
        finally:
            del self._routing[key]
            routing.set()

    async def _on_request(self, event: RequestAccepted) -> None:
        assert event.request_id is not None
        if event.spec.deadline < utc_now():  # replayed or stuck: nobody waits for it any more
            await self._fail(event, "timeout", "the request's deadline passed before routing")
            return
        with self._tracer.start_as_current_span("planner.route", context=context_of(event)) as span:
            span.set_attribute("laneway.request_id", event.request_id)
            with self.metrics.decision_seconds.time():
                try:
                    await self._route(event)
                except SessionRefused as refused:
                    # Redelivering it would be refused again, each second until its deadline.
                    log.warning("request %s failed: %s", event.request_id, refused)
                    await self._fail(event, "invalid_request", str(refused))

    async def _route(self, event: RequestAccepted) -> None:
        assert event.request_id is not None
        spec = event.spec
        prompt_tokens, max_tokens = len(spec.prompt_token_ids), spec.sampling.max_tokens
        # The session as the planner keeps it: within the request's tenant.
        session = None if event.session_id is None else session_key(spec.tenant, event.session_id)
        expected = None
        if self._lengths is not None:
            expected = self._lengths.predict(session, prompt_tokens, max_tokens)
        route = RouteRequest(
            event.request_id,
            prompt_tokens,
            spec.block_hashes,
            event.session_id,
            max_tokens,
            expected,
            spec.priority,
            spec.sampling.structured_output is not None,
            spec.lora,
        )
        overlaps: dict[str, int] | None = None
        host_runs: dict[str, int] | None = None
        if spec.block_hashes and self._policy.wants_overlap(route):
            overlaps, host_runs = await self._overlaps.ask(spec.block_hashes)
        owner = None
        if self._sessions is not None and session is not None:
            owner = await self._sessions.owner(session)
        avoid = frozenset(spec.avoid_workers)
        inputs = self.cluster.decision_inputs(route, overlaps, owner, host_runs, spec.model, avoid)
        if not inputs.decoders:
            # Workers come and go (a start, a restart): give one a moment before giving up.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._workers_changed.wait(), self._no_worker_grace_s)
            inputs = self.cluster.decision_inputs(
                route, overlaps, owner, host_runs, spec.model, avoid
            )
        if not inputs.decoders:
            await self._fail(
                event, "no_worker", f"no worker is registered to serve the model {spec.model!r}"
            )
            return
        decision = decide(self._policy, self._disagg, inputs)
        # Booked before any wait, so the requests routed meanwhile (a burst is routed at once)
        # see this one queued there rather than all picking the same idle worker.
        self._book(event, decision, expected, session)
        if self._sessions is not None and session is not None:
            try:
                bound = await self._bind_session(session, owner, decision, inputs)
            except BaseException:
                # Not routed after all (etcd refused or failed: failed or redelivered); the
                # worker's queue counts the prompt until its next load report.
                self.cluster.finished(event.request_id)
                raise
            if bound.worker_id != decision.worker_id:
                # Rare (another replica claimed the session first): booked again; the first
                # worker's queue counts the prompt until its next load report.
                self._book(event, bound, expected, session)
            decision = bound
        self.metrics.decided(decision, spec.model)
        if spec.attempt:
            self.metrics.migrations.inc()
        worker_id, remote = decision.worker_id, decision.prefill_worker_id
        span = trace.get_current_span()
        span.set_attribute("laneway.worker_id", worker_id)
        if remote is not None:
            span.set_attribute("laneway.prefill_worker_id", remote)
        fields = decision.route_fields()
        fields["reason"] = migrated_reason(spec.attempt, decision.reason)
        route_decided = RouteDecided(
            # One decision per attempt: a re-routing after a crash is dropped as a duplicate.
            event_id=f"route-{_attempt_id(event.request_id, spec.attempt)}",
            source=self._source,
            request_id=event.request_id,
            session_id=event.session_id,
            trace=trace_context(),
            spec=spec,
            **fields,
        )
        placed = RequestPlaced(
            event_id=f"placed-{_attempt_id(event.request_id, spec.attempt)}",
            source=self._source,
            request_id=event.request_id,
            session_id=event.session_id,
            worker_id=worker_id,
            attempt=spec.attempt,
        )
        # The ingress takes this attempt's tokens from worker_id alone (only the planner
        # publishes placements): queued first, so that it goes in one write with the route,
        # whose confirmation is then waited for.
        reconnects = self._bus.reconnects
        await self._bus.publish(Subjects.placements(spec.reply_to), placed)
        await self._bus.publish(Subjects.route(worker_id), route_decided)
        if self._bus.reconnects != reconnects:
            # Nothing confirms a placement, which a connection lost meanwhile may have lost
            # with it; the route's confirmation came after a reconnect, so say it again (an
            # ingress takes the first it hears, the stream drops the copy by its id).
            await self._bus.publish(Subjects.placements(spec.reply_to), placed)
        if remote is not None:
            # The same decision, to the worker that computes the prompt.
            prefill_copy = route_decided.model_copy(
                update={"event_id": f"{route_decided.event_id}-prefill"}
            )
            await self._bus.publish(Subjects.route(remote), prefill_copy)

    def _book(
        self, event: RequestAccepted, decision: Decision, expected: int | None, session: str | None
    ) -> None:
        assert event.request_id is not None
        spec = event.spec
        self.cluster.routed(
            event.request_id,
            Routed(
                decision.worker_id, spec.reply_to, event.session_id, spec.attempt, expected, session
            ),
            decision.queued_tokens,
            time.time(),
            decision.prefill_worker_id,
            spec.lora,
        )

    async def _bind_session(
        self, session_id: str, owner: str | None, decision: Decision, inputs: DecisionInputs
    ) -> Decision:
        """Record who owns the session now; another replica's earlier claim wins a race."""
        assert self._sessions is not None
        chosen = decision.worker_id
        if owner is None:
            winner = await self._sessions.claim(session_id, chosen)
            self.metrics.session_claims.labels("claimed" if winner == chosen else "lost").inc()
            if winner != chosen and any(c.worker_id == winner for c in inputs.decoders):
                return rebind(decision, inputs, winner)
        elif owner != chosen:
            await self._sessions.move(session_id, chosen)
            self.metrics.session_claims.labels("moved").inc()
        return decision

    async def _fail(self, event: RequestAccepted, code: FailureCode, message: str) -> None:
        self.metrics.failures.labels(code).inc()
        await self._bus.publish(
            Subjects.planner_failures(event.spec.reply_to),
            RequestFailed(
                event_id=f"failed-{_attempt_id(event.request_id, event.spec.attempt)}",
                source=self._source,
                request_id=event.request_id,
                session_id=event.session_id,
                trace=trace_context(),
                code=code,
                message=message,
                attempt=event.spec.attempt,
            ),
        )

    async def on_terminal(self, event: TerminalEvent) -> None:
        route = None
        if event.request_id:
            route = self.cluster.finished(event.request_id, event.worker_id)
        if self._lengths is not None and isinstance(event, RequestFinished):
            usage = event.usage
            # Its session within its tenant, which only the route knows (a request another
            # replica routed teaches this one lengths by prompt length alone).
            session = route.session_key if route is not None else None
            self._lengths.observe(session, usage.prompt_tokens, usage.completion_tokens)
            if route is not None and route.expected_tokens is not None:
                error = abs(route.expected_tokens - usage.completion_tokens)
                self.metrics.output_length_error.observe(error)

    async def on_load(self, event: WorkerLoadReported) -> None:
        self.cluster.report(event)

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        lost = self.cluster.set_workers(workers)
        # Wake requests waiting for a worker, then arm the event for the next change.
        self._workers_changed.set()
        self._workers_changed = asyncio.Event()
        for request_id, route in lost.items():
            self.metrics.failures.labels("worker_lost").inc()
            log.warning("worker %s lost with request %s in flight", route.worker_id, request_id)
            await self._bus.publish(
                Subjects.planner_failures(route.reply_to),
                RequestFailed(
                    event_id=f"failed-{_attempt_id(request_id, route.attempt)}",
                    source=self._source,
                    request_id=request_id,
                    session_id=route.session_id,
                    code="worker_lost",
                    message=f"worker {route.worker_id} stopped responding (lease expired)",
                    worker_id=route.worker_id,
                    attempt=route.attempt,
                ),
            )


def _attempt_id(request_id: str | None, attempt: int) -> str:
    """The request's id in its events' ids: each attempt (migration) decides and fails anew."""
    return f"{request_id}-{attempt}" if attempt else f"{request_id}"
