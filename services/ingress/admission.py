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

Several ingress replicas share the cluster: each counts its own requests exactly, and the
others' from the workers' load reports (running + waiting: every replica's requests) less the
most of its own that the reports can show: its highest count over the ``report_lag_s`` before
each report came. So its own requests are never counted twice, and a burst by several replicas
at once overshoots by at most what they admit within one report interval (a busy worker reports
every 50 ms), which the workers' own queues absorb.

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
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from schemas.events import WorkerLoadReported
from schemas.messages import WorkerRegistration
from services.common.liveness import Liveness
from services.ingress.errors import Overloaded
from services.ingress.metrics import IngressMetrics

Priority = Literal["high", "normal", "low"]
# Best first: a waiter's rank is its index here.
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
ShedReason = Literal["queue_full", "wait_timeout", "displaced"]


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

    def __post_init__(self) -> None:
        if min(self.queue_per_worker, self.max_queue) < 0 or self.retry_after_s < 1:
            raise ValueError("admission queues must be >= 0 and retry_after_s >= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be positive")
        if min(self.max_wait_s, self.report_lag_s, self.report_ttl_s) < 0:
            raise ValueError("admission times must be >= 0")


class _Peak:
    """The highest value a count took over the last ``window_s`` seconds (a monotonic deque:
    each sample is larger than every later one)."""

    __slots__ = ("_clock", "_samples", "_window_s")

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def record(self, value: int) -> None:
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((self._clock(), value))

    def peak(self, now_value: int) -> int:
        horizon = self._clock() - self._window_s
        samples = self._samples
        # The newest sample stays: it is the current value until the next change.
        while len(samples) > 1 and samples[0][0] < horizon:
            samples.popleft()
        return max(now_value, samples[0][1]) if samples else now_value


class _Waiter:
    __slots__ = ("future", "priority")

    def __init__(self, priority: Priority) -> None:
        self.priority = priority
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
        self._own_peak = _Peak(settings.report_lag_s, clock)
        self._worker_slots: dict[str, int] = {}
        # worker id → its last report: requests it holds, when it came, and the most of this
        # replica's own requests it can count.
        self._reports: dict[str, tuple[int, float, int]] = {}
        self._waiting: dict[Priority, deque[_Waiter]] = {p: deque() for p in PRIORITIES}

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
        return sum(len(q) for q in self._waiting.values())

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

    def _add_own(self, delta: int) -> None:
        self._own += delta
        self._own_peak.record(self._own)

    async def admit(self, priority: Priority) -> AdmissionTicket:
        """Room for one request, at once or after a short wait; raises Overloaded (429) if none."""
        if not self._ahead(PRIORITIES.index(priority)) and self._has_room():
            return self._admitted(priority)
        waiter = self._enqueue(priority)
        try:
            async with asyncio.timeout(self._settings.max_wait_s):
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
                self.release()
            raise
        return self._ticket(priority)

    def _has_room(self) -> bool:
        if self._pressure is not None and self._pressure():
            return False
        capacity = self.capacity
        return capacity is None or self.in_cluster < capacity

    def _ahead(self, rank: int) -> bool:
        return any(self._waiting[p] for p in PRIORITIES[: rank + 1])

    def _admitted(self, priority: Priority) -> AdmissionTicket:
        self._add_own(1)
        return self._ticket(priority)

    def _ticket(self, priority: Priority) -> AdmissionTicket:
        self._metrics.admitted.labels(priority).inc()
        return AdmissionTicket(self)

    def _enqueue(self, priority: Priority) -> _Waiter:
        if self.queued >= self._settings.max_queue:
            rank = PRIORITIES.index(priority)
            lower = next((p for p in reversed(PRIORITIES[rank + 1 :]) if self._waiting[p]), None)
            if lower is None:
                raise self._shed("queue_full", priority)
            # The oldest of that priority: the one closest to being shed anyway.
            displaced = self._waiting[lower].popleft()
            if not displaced.future.done():  # else its wait ran out just now: it leaves as shed
                displaced.future.set_exception(self._shed("displaced", lower))
        waiter = _Waiter(priority)
        self._waiting[priority].append(waiter)
        return waiter

    def _remove(self, waiter: _Waiter) -> bool:
        """Take a waiter off the queue; False if it was already taken (given room or shed)."""
        queue = self._waiting[waiter.priority]
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        return True

    def _wake(self) -> None:
        """Give the room there is to the waiters, best priority first, then newest."""
        for priority in PRIORITIES:
            queue = self._waiting[priority]
            while queue and self._has_room():
                waiter = queue.pop()
                if waiter.future.done():
                    continue  # its wait ran out just now (not yet resumed): it leaves as shed
                self._add_own(1)
                waiter.future.set_result(None)

    def _shed(self, reason: ShedReason, priority: Priority) -> Overloaded:
        self._metrics.shed.labels(reason, priority).inc()
        return Overloaded(self._settings.retry_after_s)

    def release(self) -> None:
        self._add_own(-1)
        self._wake()


def _granted(waiter: _Waiter) -> bool:
    future = waiter.future
    return future.done() and not future.cancelled() and future.exception() is None


class AdmissionTicket:
    """One admitted request's room in the cluster, given back exactly once."""

    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.release()
            self._admission = None
