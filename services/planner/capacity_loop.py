"""The capacity loop, live: one planner replica at a time (an etcd election) watches TTFT and ITL
of finished requests and the prefill pool's queue, asks the pure :class:`CapacityPlanner` what to
do, and carries a move out: new roles in etcd (each worker watches its own), then a
``RolesRebalanced`` event as the record of why. Each look, moved or not, is a
``CapacityReviewed`` event (``laneway status`` shows the last), and a target it finds out of
reach of any move is a gauge too.

Where workers serve several models (model pools), each model's workers are a cluster of their
own to it: observed apart, with a planner of their own, and never moved to serve another's
prefills."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, get_args

from prometheus_client import Counter, Gauge

from bus.channels import Topic
from bus.registry import LeasedKey
from bus.topology import Subjects
from schemas.envelope import Envelope
from schemas.events import CapacityReviewed, RequestFinished, Role, RoleMove, RolesRebalanced
from schemas.latency import LatencyHistogram
from services.planner.capacity import (
    CapacityPlanner,
    Decision,
    Observation,
    Target,
    observe_interval,
    workers_to_move,
)
from services.planner.cluster import ClusterView
from services.planner.policy import WorkerView

log = logging.getLogger(__name__)

AssignRoles = Callable[[dict[str, Role]], Awaitable[None]]
E = TypeVar("E", bound=Envelope)


class Publish(Protocol):
    async def __call__(self, topic: Topic[E], event: E, /) -> None: ...


class CapacityLoop:
    def __init__(
        self,
        planner: CapacityPlanner,
        cluster: ClusterView,
        leadership: LeasedKey,
        assign_roles: AssignRoles,
        publish: Publish,
        source: str,
        moves: Counter | None = None,
        out_of_reach: Gauge | None = None,
    ) -> None:
        """``moves``: counts the workers moved, labelled by the pool they join; ``out_of_reach``:
        1 for each target no move can meet, by target and model. ``planner`` plans for one
        model; a model pool beside it gets a planner of its own, of the same settings."""
        self._planner = planner
        self._planners: dict[str, CapacityPlanner] = {}
        self._moves = moves
        self._out_of_reach = out_of_reach
        self._cluster = cluster
        self._leadership = leadership
        self._assign_roles = assign_roles
        self._publish = publish
        self._source = source
        # Recent requests with when they finished (monotonic seconds), oldest first.
        self._finished: deque[tuple[float, RequestFinished]] = deque()

    def on_finished(self, event: RequestFinished) -> None:
        self._finished.append((time.monotonic(), event))

    async def run(self) -> None:
        interval = self._planner.settings.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                if await self._leadership.start_if_absent():
                    for model in self.models():
                        await self.step(model)
                else:
                    self._forget_before(time.monotonic() - interval)
            except asyncio.CancelledError:
                raise
            except Exception:  # etcd unreachable for a moment: try again next interval
                log.warning("capacity step failed", exc_info=True)

    def _forget_before(self, since: float) -> None:
        while self._finished and self._finished[0][0] < since:
            self._finished.popleft()

    def models(self) -> list[str | None]:
        """The model pools to plan for: None, the whole cluster, where its workers serve one."""
        models = sorted({reg.model for reg in self._cluster.workers.values()})
        return [None] if len(models) < 2 else list(models)

    def observe(self, model: str | None = None) -> Observation:
        """The last interval's latencies and the pools as they stand, of ``model``'s workers
        (None: all)."""
        self._forget_before(time.monotonic() - self._planner.settings.interval_s)
        done = [event for _, event in self._finished if self._serves(event.worker_id, model)]
        gaps = LatencyHistogram()
        for event in done:
            gaps.merge(event.token_gaps)
        prefill = self._pool("prefill", model)
        return observe_interval(
            [(e.ttft_ms, e.prefill_worker_id is not None) for e in done],
            gaps,
            sum(e.stalled_gaps for e in done),
            sum(w.waiting_prefill_tokens for w in prefill),
            len(prefill),
            len(self._pool("decode", model)),
        )

    def _serves(self, worker_id: str, model: str | None) -> bool:
        reg = self._cluster.workers.get(worker_id)
        return model is None or (reg is not None and reg.model == model)

    def _pool(self, role: Role, model: str | None) -> list[WorkerView]:
        # Aggregated workers decode too: the loop may split them into a prefill pool.
        quiet = self._cluster.quiet()
        if role == "prefill":
            return self._cluster.prefill_candidates(leave_out=quiet, model=model)
        return self._cluster.candidates(leave_out=quiet, model=model)

    async def step(self, model: str | None = None) -> RolesRebalanced | None:
        """One interval's decision for ``model``'s workers (None: the whole cluster's)."""
        planner = self._planner
        if model is not None:
            planner = self._planners.setdefault(model, CapacityPlanner(planner.settings))
        observed = self.observe(model)
        decision = planner.decide(observed)
        event = await self._move(model, decision)
        await self._review(model, planner, observed, decision, event)
        return event

    async def _move(self, model: str | None, decision: Decision) -> RolesRebalanced | None:
        if decision.move is None:
            return None
        source: Role = "decode" if decision.move == "to_prefill" else "prefill"
        target: Role = "prefill" if source == "decode" else "decode"
        moved = workers_to_move(self._pool(source, model), decision.workers)
        if not moved:
            return None
        await self._assign_roles(dict.fromkeys(moved, target))
        event = RolesRebalanced(
            source=self._source,
            moves=tuple(
                RoleMove(worker_id=w, from_role=self._cluster.workers[w].role, to_role=target)
                for w in moved
            ),
            reason=decision.reason if model is None else f"{model}: {decision.reason}",
        )
        await self._publish(Subjects.roles_rebalanced, event)
        if self._moves is not None:
            self._moves.labels(target).inc(len(moved))
        log.info("capacity: %s → %s for %s (%s)", source, target, moved, decision.reason)
        return event

    async def _review(
        self,
        model: str | None,
        planner: CapacityPlanner,
        observed: Observation,
        decision: Decision,
        moved: RolesRebalanced | None,
    ) -> None:
        settings = planner.settings
        if self._out_of_reach is not None:
            for target in get_args(Target):
                self._out_of_reach.labels(target, model or "").set(target in decision.out_of_reach)
        if decision.out_of_reach:
            log.warning("capacity%s: %s", f" ({model})" if model else "", decision.reason)
        review = CapacityReviewed(
            source=self._source,
            model=model,
            ttft_p95_ms=observed.ttft_p95_ms,
            itl_p95_ms=observed.itl_p95_ms,
            ttft_target_ms=settings.ttft_target_ms,
            itl_target_ms=settings.itl_target_ms,
            prefill_workers=observed.prefill_workers,
            decode_workers=observed.decode_workers,
            moved=0 if moved is None else len(moved.moves),
            reason=decision.reason[:1024],
            out_of_reach=decision.out_of_reach,
        )
        await self._publish(Subjects.capacity_reviewed, review)
