"""Which registered workers are live: one rule for the planner (whom it routes to) and the ingress
(whom ``/health`` and admission count), plain bookkeeping with no I/O.

A worker is live while it is registered in etcd under a lease (:func:`bus.registry.watch_workers`
leaves out a key without one) and it has been heard from within ``QUIET_S``: registered, or a
load report (``lw.load.<worker>``, which only that worker may publish). A lease alone says too
little: any etcd user may keep any lease alive, so a frozen worker (SIGSTOP) stayed registered
for as long as someone else refreshed its lease; its load reports stop all the same, and it is
live again as soon as they resume."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# A worker reports its load at least every 0.5 s (LANEWAY_LOAD_REPORT_INTERVAL_S; every 50 ms
# while busy): one silent for four such intervals is taken for dead or frozen.
QUIET_S = 2.0


class Liveness:
    def __init__(
        self, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._quiet_s = quiet_s
        self._clock = clock
        # Per registered worker, when it was last heard from, on ``clock``.
        self._heard: dict[str, float] = {}

    def registered(self, workers: Iterable[str]) -> None:
        """The registered set now: a worker new to it counts as heard from now, one gone from it
        is forgotten (a report of its that comes late does not bring it back)."""
        now = self._clock()
        heard = self._heard
        self._heard = {worker: heard.get(worker, now) for worker in workers}

    def reported(self, worker_id: str) -> None:
        """A load report of ``worker_id`` came (one of a worker not registered is ignored)."""
        if worker_id in self._heard:
            self._heard[worker_id] = self._clock()

    def quiet(self) -> set[str]:
        """Registered workers not heard from for ``QUIET_S``."""
        horizon = self._clock() - self._quiet_s
        return {worker for worker, heard in self._heard.items() if heard < horizon}

    def live(self) -> set[str]:
        """Registered workers heard from within ``QUIET_S``."""
        horizon = self._clock() - self._quiet_s
        return {worker for worker, heard in self._heard.items() if heard >= horizon}

    @property
    def registered_count(self) -> int:
        return len(self._heard)
