"""Admission control: how many requests the cluster may hold, and who waits or is shed beyond it.

The cluster holds at most ``capacity`` requests: each serving worker's ``max_num_seqs`` plus a
short queue of ``queue_per_worker`` (workers' records in etcd), and never more than a fixed
``max_in_flight`` when the operator sets one. A request beyond it waits here, in a bounded
queue ordered by priority, for at most ``max_wait_s``; past that, or with the queue full, it is
shed (429). Within a priority the newest waiter gets room first: under overload the oldest are
about to be shed anyway, and serving the newest keeps the admitted requests' wait, part of
their time to first token, near zero instead of near ``max_wait_s``. A newcomer finding the
queue full sheds the oldest waiter of a lower priority, if any, instead of itself: low priority
is shed first, high waits first.

With API keys, room is shared by weighted fair share among the tenants asking for it
(:mod:`services.ingress.fair_share`): within a priority the tenant using least of its share gets
room first, a tenant over its share gets none that is held back for a tenant below it, and a
full queue sheds the waiter of the tenant most over its share before a newcomer below it. While
tenants contend, this is fair queuing: each tenant's waiters keep their order and wait up to
``share_wait_s`` (1 s) instead of ``max_wait_s``, so a tenant far over its share waits its own
queue out while one within it finds room at once or at the next release. Without keys there is
one tenant and none of this changes anything.

Several ingress replicas share the cluster: each counts its own requests exactly, and the
others' from the workers' load reports (running + waiting: every replica's requests) less the
most of its own that the reports can show: its highest count over the ``report_lag_s`` before
each report came. So its own requests are never counted twice, and a burst by several replicas
at once overshoots by at most what they admit within one report interval (a worker reports
within 50 ms of a request queuing, starting or ending), which the workers' own queues absorb.

An ingress that falls behind its own work (``pressure``: its event loop runs late, see
:mod:`services.ingress.loop_lag`) has no room either until it catches up: a new request waits
here, or is shed, rather than slowing every stream it already serves until the bus drops it as
a slow consumer.

No bound is known until a worker registers (or ``max_in_flight`` is set): until then every
request goes on, as the context limit does, and the planner answers if no worker can serve it.
A registered worker that is not live (silent: services.common.liveness, as the planner judges
it) adds no room, unless none is live: the planner then routes to them all the same.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from schemas.events import WorkerLoadReported
from schemas.messages import WorkerRegistration
from services.common.liveness import Liveness
from services.ingress.errors import Overloaded
from services.ingress.fair_share import FairShare, Peak, Tenant
from services.ingress.metrics import IngressMetrics

Priority = Literal["high", "normal", "low"]
# Best first: a waiter's rank is its index here.
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
ShedReason = Literal["queue_full", "wait_timeout", "displaced"]
# Free room where no bound is known: more than any queue could ask for.
_UNBOUNDED = sys.maxsize


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSettings:
    queue_per_worker: int = 0
    """Requests each worker may hold waiting beyond its ``max_num_seqs``."""
    max_in_flight: int | None = None
    """A fixed bound on the requests in the cluster, besides the workers' (None: theirs only)."""
    max_queue: int = 256
    """Requests that may wait here for room, all priorities together."""
    max_wait_s: float = 0.025
    """Longest a request waits here for room before it is shed."""
    retry_after_s: int = 1
    """What a shed request's ``Retry-After`` tells the client to wait, seconds."""
    report_lag_s: float = 0.25
    """How stale a worker's load report may be, as seen here (its busy interval and transit)."""
    report_ttl_s: float = 5.0
    """A worker's report older than this no longer counts (a worker that went quiet)."""
    share_wait_s: float = 1.0
    """Longest a request waits for room while tenants contend (no longer than the
    ``Retry-After`` a shed request would be told to wait)."""
    share_window_s: float = 1.0
    """How long a tenant counts as active after its last request here, and over which its
    demand is the most it held and queued at once (services.ingress.fair_share)."""

    def __post_init__(self) -> None:
        if min(self.queue_per_worker, self.max_queue) < 0 or self.retry_after_s < 1:
            raise ValueError("admission queues must be >= 0 and retry_after_s >= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be positive")
        times = (self.max_wait_s, self.share_wait_s, self.share_window_s)
        if min(*times, self.report_lag_s, self.report_ttl_s) < 0:
            raise ValueError("admission times must be >= 0")


class _Waiter:
    __slots__ = ("future", "priority", "tenant")

    def __init__(self, priority: Priority, tenant: Tenant) -> None:
        self.priority = priority
        self.tenant = tenant
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Admission:
    def __init__(
        self,
        settings: AdmissionSettings,
        metrics: IngressMetrics,
        clock: Callable[[], float] = time.monotonic,
        pressure: Callable[[], bool] | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        """``liveness``: the workers as the ingress hears of them (fed by its caller; None:
        every registered worker counts). One model pool's (the ingress's admission gauges sum
        the pools: services.ingress.pool_admission)."""
        self._settings = settings
        self._liveness = liveness
        self._pressure = pressure
        self._metrics = metrics
        self._clock = clock
        self._own = 0
        self._own_peak = Peak(settings.report_lag_s, clock)
        self._fair = FairShare(settings.share_window_s, clock)
        self._worker_slots: dict[str, int] = {}
        # worker id → its last report: requests it holds, when it came, and the most of this
        # replica's own requests it can count.
        self._reports: dict[str, tuple[int, float, int]] = {}
        # Per priority, each tenant's waiters, oldest first (a tenant with none has no entry).
        self._waiting: dict[Priority, dict[Tenant, deque[_Waiter]]] = {p: {} for p in PRIORITIES}

    @property
    def capacity(self) -> int | None:
        """The most requests the cluster may hold; None: no bound known yet."""
        bounds = [self._settings.max_in_flight]
        if self._worker_slots:
            bounds.append(self._live_slots())
        return min((b for b in bounds if b is not None), default=None)

    def _live_slots(self) -> int:
        slots = self._worker_slots
        if self._liveness is not None:
            live = self._liveness.live()
            room = [n for worker, n in slots.items() if worker in live]
            if room:
                return sum(room)
        return sum(slots.values())

    @property
    def in_cluster(self) -> int:
        """Requests in the cluster as this replica sees them: its own and the others'."""
        horizon = self._clock() - self._settings.report_ttl_s
        fresh = [
            report
            for worker, report in self._reports.items()
            if worker in self._worker_slots and report[1] >= horizon
        ]
        reported = sum(held for held, _, _ in fresh)
        own_shown = max((own for _, _, own in fresh), default=0)
        return self._own + max(0, reported - own_shown)

    @property
    def queued(self) -> int:
        return sum(len(q) for queues in self._waiting.values() for q in queues.values())

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        queue = self._settings.queue_per_worker
        self._worker_slots = {
            w.worker_id: w.max_num_seqs + queue
            for w in workers.values()
            # Prefill workers take no request of their own; a draining worker takes none new.
            if w.role != "prefill" and not w.draining
        }
        self._reports = {k: v for k, v in self._reports.items() if k in workers}
        self._wake()

    async def on_load(self, report: WorkerLoadReported) -> None:
        held = report.running + report.waiting
        self._reports[report.worker_id] = (held, self._clock(), self._own_peak.peak(self._own))
        self._wake()

    def _add_own(self, delta: int, tenant: Tenant) -> None:
        self._own += delta
        self._own_peak.record(self._own)
        self._fair.count(tenant, held=delta)

    async def admit(
        self, priority: Priority, tenant: Tenant = None, weight: float = 1.0
    ) -> AdmissionTicket:
        """Room for one request of ``tenant`` (of ``weight``: its share), at once or after a
        short wait; raises Overloaded (429) if none."""
        self._fair.arrived(tenant, weight)
        if not self._ahead(PRIORITIES.index(priority)) and self._has_room(tenant):
            return self._admitted(priority, tenant)
        waiter = self._enqueue(priority, tenant)
        # Waiters of a tenant over its share may be kept from room this one may take.
        self._wake()
        wait_s = self._settings.max_wait_s
        if self._fair.contended():
            # Tenants contend: each waits its turn in its tenant's queue, as in fair queuing,
            # no longer than a shed client would be told to (Retry-After). A tenant within its
            # share finds room held back for it and waits little; one far over it waits its
            # own queue out, or is shed at the end of it.
            wait_s = max(wait_s, self._settings.share_wait_s)
        try:
            async with asyncio.timeout(wait_s):
                await waiter.future
        except TimeoutError:
            # Still queued, or taken off it (displaced) only once the timeout had cancelled it.
            if self._remove(waiter) or waiter.future.cancelled():
                raise self._shed("wait_timeout", priority) from None
            # Given room (or displaced) just as the wait ran out: the 429 of a displacement
            # is raised here, room is taken.
            waiter.future.result()
        except asyncio.CancelledError:
            if not self._remove(waiter) and _granted(waiter):
                # Handed room just as the client left: give it to the next.
                self.release(tenant)
            raise
        return self._ticket(priority, tenant)

    def _room(self) -> tuple[int, int, int]:
        """The free room in the pool (none while this replica is behind), the other replicas'
        requests in it, and its capacity; unbounded, room for anything."""
        if self._pressure is not None and self._pressure():
            return 0, 0, 0
        capacity = self.capacity
        if capacity is None:
            return _UNBOUNDED, 0, 0
        in_cluster = self.in_cluster
        return capacity - in_cluster, in_cluster - self._own, capacity

    def _has_room(self, tenant: Tenant) -> bool:
        free, others, capacity = self._room()
        return free > 0 and self._fair.may_take(tenant, free, others, capacity)

    def _ahead(self, rank: int) -> bool:
        return any(self._waiting[p] for p in PRIORITIES[: rank + 1])

    def _admitted(self, priority: Priority, tenant: Tenant) -> AdmissionTicket:
        self._add_own(1, tenant)
        return self._ticket(priority, tenant)

    def _ticket(self, priority: Priority, tenant: Tenant) -> AdmissionTicket:
        self._metrics.admitted.labels(priority).inc()
        return AdmissionTicket(self, tenant)

    def _enqueue(self, priority: Priority, tenant: Tenant) -> _Waiter:
        if self.queued >= self._settings.max_queue:
            self._displace(priority, tenant)
        waiter = _Waiter(priority, tenant)
        self._waiting[priority].setdefault(tenant, deque()).append(waiter)
        self._fair.count(tenant, queued=1)
        return waiter

    def _displace(self, priority: Priority, tenant: Tenant) -> None:
        """Make a place in the full queue for a newcomer: shed the oldest waiter of the lowest
        priority below its own, of the tenant there using most of its share; with none below,
        of its own priority, if a tenant uses more of its share than the newcomer's; else shed
        the newcomer (low priority is shed first, a tenant over its share next)."""
        rank = PRIORITIES.index(priority)
        lower = next((p for p in reversed(PRIORITIES[rank + 1 :]) if self._waiting[p]), None)
        _, others, capacity = self._room()
        if lower is not None:
            over = self._fair.most_over(self._waiting[lower], others, capacity)
        else:
            lower = priority
            # The newcomer's tenant first: on a tie it is the newcomer that goes.
            over = self._fair.most_over([tenant, *self._waiting[priority]], others, capacity)
            if over == tenant:
                raise self._shed("queue_full", priority)
        # The oldest: the one closest to being shed anyway.
        displaced = self._pop(lower, over, newest=False)
        if not displaced.future.done():  # else its wait ran out just now: it leaves as shed
            displaced.future.set_exception(self._shed("displaced", lower))

    def _pop(self, priority: Priority, tenant: Tenant, newest: bool) -> _Waiter:
        queues = self._waiting[priority]
        queue = queues[tenant]
        waiter = queue.pop() if newest else queue.popleft()
        if not queue:
            del queues[tenant]
        self._fair.count(tenant, queued=-1)
        return waiter

    def _remove(self, waiter: _Waiter) -> bool:
        """Take a waiter off the queue; False if it was already taken (given room or shed)."""
        queues = self._waiting[waiter.priority]
        queue = queues.get(waiter.tenant)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del queues[waiter.tenant]
        self._fair.count(waiter.tenant, queued=-1)
        return True

    def _wake(self) -> None:
        """Give the room there is to the waiters: best priority first, then the tenant using
        least of its share that may take room (services.ingress.fair_share), then its newest
        (its oldest while tenants contend)."""
        # One tenant: the newest, whose wait is shortest (the oldest are about to be shed
        # anyway). Tenants contending: each tenant's queue in its order.
        newest = not self._fair.contended()
        for priority in PRIORITIES:
            queues = self._waiting[priority]
            while queues:
                free, others, capacity = self._room()
                if free <= 0:
                    return
                try:
                    tenant = self._fair.first(queues, free, others, capacity)
                except LookupError:
                    break  # a worse priority may hold a waiter of a tenant that may
                waiter = self._pop(priority, tenant, newest=newest)
                if waiter.future.done():
                    continue  # its wait ran out just now (not yet resumed): it leaves as shed
                self._add_own(1, tenant)
                waiter.future.set_result(None)

    def _shed(self, reason: ShedReason, priority: Priority) -> Overloaded:
        self._metrics.shed.labels(reason, priority).inc()
        return Overloaded(self._settings.retry_after_s)

    def release(self, tenant: Tenant = None) -> None:
        self._add_own(-1, tenant)
        self._wake()


def _granted(waiter: _Waiter) -> bool:
    future = waiter.future
    return future.done() and not future.cancelled() and future.exception() is None


class AdmissionTicket:
    """One admitted request's room in the cluster, given back exactly once."""

    __slots__ = ("_admission", "_tenant")

    def __init__(self, admission: Admission, tenant: Tenant) -> None:
        self._admission: Admission | None = admission
        self._tenant = tenant

    def release(self) -> None:
        if self._admission is not None:
            self._admission.release(self._tenant)
            self._admission = None
