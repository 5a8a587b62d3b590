"""The planner's view of the cluster: live workers, their latest load, and what it routed where.

Plain bookkeeping with no I/O; the service feeds it events and asks it for candidates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from schemas.events import WorkerLoadReported
from schemas.messages import DEFAULT_MODEL, WorkerRegistration
from services.common.liveness import QUIET_S, Liveness
from services.planner.adapters import adapters_ahead
from services.planner.decision import DecisionInputs
from services.planner.policy import RouteRequest, WorkerView
from services.planner.routable import with_room

log = logging.getLogger(__name__)

# How a recorded decision of a request that moved to another worker begins its reason.
MIGRATED = "migrated (attempt {attempt}): "


def migrated_reason(attempt: int, reason: str) -> str:
    """The recorded reason of a decision; one of a later attempt (a migration) says so first."""
    return MIGRATED.format(attempt=attempt) + reason if attempt else reason


def decided_reason(recorded: str, attempt: int) -> str:
    """The reason ``decide()`` gave for a recorded decision of ``attempt`` (a replay's)."""
    return recorded.removeprefix(MIGRATED.format(attempt=attempt))


# Roles that decode, and so can serve a request end to end in aggregated mode.
SERVING_ROLES = frozenset({"both", "decode"})
PREFILL_ROLES = frozenset({"prefill"})


@dataclass(frozen=True, slots=True)
class Routed:
    worker_id: str
    reply_to: str
    session_id: str | None
    attempt: int = 0
    """Times the request moved to another worker before this route (migration)."""
    expected_tokens: int | None = None
    """The output length it was routed with, when a predictor gave one."""
    session_key: str | None = None
    """Its session within its tenant (``bus.sessions.session_key``), what is learnt per session."""


class ClusterView:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.workers: dict[str, WorkerRegistration] = {}
        self._load: dict[str, WorkerLoadReported] = {}
        # Who is live, by the ingress's rule too (services.common.liveness).
        self.liveness = Liveness(QUIET_S, clock)
        self._routed: dict[str, Routed] = {}
        self._in_flight: dict[str, int] = {}
        # Per worker, (when, prompt tokens) routed there that its last report may not include.
        self._unreported: dict[str, deque[tuple[float, int]]] = {}
        # Per worker, (when, LoRA adapter) routed there since its last report, in order: used,
        # and loaded where not held, before a request routed now runs.
        self._adapters_routed: dict[str, deque[tuple[float, str]]] = {}
        # Models asked of workers that name none (see _pool_of), each warned of once.
        self._unnamed: set[str] = set()

    def set_workers(self, workers: dict[str, WorkerRegistration]) -> dict[str, Routed]:
        """Replace the live set; returns the requests that were in flight on workers now gone."""
        gone = self.workers.keys() - workers.keys()
        self.liveness.registered(workers)
        self.workers = workers
        lost = {rid: r for rid, r in self._routed.items() if r.worker_id in gone}
        for request_id in lost:
            self.finished(request_id)
        for worker_id in gone:
            self._load.pop(worker_id, None)
            self._in_flight.pop(worker_id, None)
            self._unreported.pop(worker_id, None)
            self._adapters_routed.pop(worker_id, None)
        return lost

    def report(self, load: WorkerLoadReported) -> None:
        if load.worker_id not in self.workers:
            return
        self._load[load.worker_id] = load
        reported_at = load.occurred_at.timestamp()
        self.liveness.reported(load.worker_id, reported_at)
        pending = self._unreported.get(load.worker_id)
        while pending and pending[0][0] <= reported_at:
            pending.popleft()
        routed = self._adapters_routed.get(load.worker_id)
        while routed and routed[0][0] <= reported_at:
            routed.popleft()

    def quiet(self) -> set[str]:
        """Workers not heard from for ``QUIET_S``: their lease may still stand (a killed or
        frozen worker keeps it until it expires, or for as long as anyone keeps it alive) while
        they serve nothing. A request routed there would wait for a migration, and a capacity
        move counting one could take the last worker that really serves."""
        return self.liveness.quiet()

    def routed(
        self,
        request_id: str,
        route: Routed,
        prefill_tokens: int,
        now: float,
        prefill_worker: str | None = None,
        lora: str | None = None,
    ) -> None:
        """``now``: wall-clock seconds, comparable with the reports' ``occurred_at``. The prompt
        queues on ``prefill_worker`` when it prefills remotely, else on the decode worker; its
        LoRA adapter ``lora`` is loaded on both."""
        self.finished(request_id)  # an earlier attempt's route, where it moved from
        self._routed[request_id] = route
        self._in_flight[route.worker_id] = self._in_flight.get(route.worker_id, 0) + 1
        queue = prefill_worker or route.worker_id
        self._unreported.setdefault(queue, deque()).append((now, prefill_tokens))
        if lora is not None:
            for worker_id in {route.worker_id, queue}:
                self._adapters_routed.setdefault(worker_id, deque()).append((now, lora))

    def is_routed(self, request_id: str, attempt: int = 0) -> bool:
        """This attempt of the request (or a later one) has its route already."""
        route = self._routed.get(request_id)
        return route is not None and route.attempt >= attempt

    def finished(self, request_id: str, worker_id: str | None = None) -> Routed | None:
        """The request ended; ``worker_id``: on that worker, so not a later attempt's route.
        Returns the route it ended, if this planner made it."""
        route = self._routed.get(request_id)
        if route is None or (worker_id is not None and route.worker_id != worker_id):
            return None
        del self._routed[request_id]
        if route.worker_id in self._in_flight:
            self._in_flight[route.worker_id] -= 1
        return route

    def decision_inputs(
        self,
        request: RouteRequest,
        cached_blocks: dict[str, int] | None,
        session_owner: str | None,
        host_blocks: dict[str, int] | None = None,
        model: str | None = None,
        avoid: AbstractSet[str] = frozenset(),
    ) -> DecisionInputs:
        """What a routing decision for ``request`` needs to know about the workers now;
        ``host_blocks``: the blocks each one's host tier holds after its GPU overlap;
        ``model``: the model it asks for, which only its pool's workers are candidates for;
        ``avoid``: workers its earlier attempts left or its ingress hears late, weighed only
        when no other can take it."""
        slots = {worker_id: reg.max_num_seqs for worker_id, reg in self.workers.items()}
        quiet = self.quiet()
        model = self._pool_of(model)
        # Only workers that hold adapters run a request with one.
        unable: set[str] = set()
        if request.lora is not None:
            unable = {w for w, reg in self.workers.items() if not reg.max_loras}
        serving = self.candidates(
            cached_blocks, session_owner, host_blocks, leave_out=quiet | unable | avoid, model=model
        )
        if not serving and avoid:
            # The ingress hears some workers late, this planner others (a planner behind a slow
            # link hears every worker but its neighbours late): the ingress's word wins, as the
            # answer's tokens go to it. Then the workers it avoids, if no other can serve.
            for leave_out in (self.liveness.silent() | unable | avoid, quiet | unable):
                serving = self.candidates(
                    cached_blocks, session_owner, host_blocks, leave_out=leave_out, model=model
                )
                if serving:
                    break
        # When every server (every pool's) is silent the bus or this planner stalled, not all
        # the workers: routing to them then beats refusing. A silent prefill worker is simply
        # not used.
        if not serving and not self.candidates(leave_out=quiet):
            serving = self.candidates(
                cached_blocks, session_owner, host_blocks, leave_out=unable, model=model
            )
        return DecisionInputs(
            request,
            with_room(serving, slots),
            self.prefill_candidates(
                cached_blocks, host_blocks, leave_out=quiet | unable | avoid, model=model
            ),
            frozenset(w for w, reg in self.workers.items() if reg.kv_handoff),
        )

    def _pool_of(self, model: str | None) -> str | None:
        """The model whose workers serve ``model``'s requests: its own, unless no worker names
        a model of its own (all register DEFAULT_MODEL): then any (None), with a warning, for
        one release. Before model pools an ingress serving other names in front of such
        workers worked, the planner ignoring the model."""
        workers = self.workers.values()
        if model is None or any(reg.model == model for reg in workers):
            return model
        if not workers or any(reg.model != DEFAULT_MODEL for reg in workers):
            return model
        if model not in self._unnamed:
            self._unnamed.add(model)
            log.warning(
                "no worker registers model %r, and all register %r: routed to them all the "
                "same; set LANEWAY_MODEL=%s on them (this goes in the next release)",
                model,
                DEFAULT_MODEL,
                model,
            )
        return None

    def candidates(
        self,
        cached_blocks: dict[str, int] | None = None,
        session_owner: str | None = None,
        host_blocks: dict[str, int] | None = None,
        leave_out: AbstractSet[str] = frozenset(),
        model: str | None = None,
    ) -> list[WorkerView]:
        """Workers that can serve a request end to end (or decode it after a remote prefill);
        of ``model``'s pool, where one is given."""
        return self._views(
            SERVING_ROLES, cached_blocks, session_owner, host_blocks, leave_out, model
        )

    def prefill_candidates(
        self,
        cached_blocks: dict[str, int] | None = None,
        host_blocks: dict[str, int] | None = None,
        leave_out: AbstractSet[str] = frozenset(),
        model: str | None = None,
    ) -> list[WorkerView]:
        """Prefill-only workers that can hand their KV over."""
        return [
            view
            for view in self._views(
                PREFILL_ROLES, cached_blocks, None, host_blocks, leave_out, model
            )
            if self.workers[view.worker_id].kv_handoff
        ]

    def _views(
        self,
        roles: frozenset[str],
        cached_blocks: dict[str, int] | None,
        session_owner: str | None,
        host_blocks: dict[str, int] | None,
        leave_out: AbstractSet[str],
        model: str | None = None,
    ) -> list[WorkerView]:
        views = []
        # In id order, as the offline replay lists them: a decision record reads the same.
        for worker_id, reg in sorted(self.workers.items()):
            if reg.role not in roles or reg.draining or worker_id in leave_out:
                continue
            if model is not None and reg.model != model:  # another pool's
                continue
            load = self._load.get(worker_id)
            loras, loads_ahead = frozenset[str](), 0
            if reg.max_loras:
                coming = (lora for _, lora in self._adapters_routed.get(worker_id, ()))
                held = load.loras if load is not None else ()
                loras, loads_ahead = adapters_ahead(held, coming, reg.max_loras)
            unreported = sum(tokens for _, tokens in self._unreported.get(worker_id, ()))
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    running=load.running if load else 0,
                    waiting=load.waiting if load else 0,
                    kv_usage=load.kv_blocks_used / load.kv_blocks_total
                    if load and load.kv_blocks_total
                    else 0.0,
                    in_flight=self._in_flight.get(worker_id, 0),
                    cached_blocks=(cached_blocks or {}).get(worker_id, 0),
                    waiting_prefill_tokens=(load.waiting_prefill_tokens if load else 0)
                    + unreported,
                    block_size=reg.block_size,
                    kv_capacity_tokens=reg.kv_blocks_total * reg.block_size,
                    owns_session=worker_id == session_owner,
                    host_blocks=(host_blocks or {}).get(worker_id, 0),
                    node=reg.node,
                    rack=reg.rack,
                    step_cost=load.step_cost if load else None,
                    kv_bytes_per_token=reg.kv_bytes_per_token,
                    loras=loras,
                    lora_loads_ahead=loads_ahead,
                )
            )
        return views
