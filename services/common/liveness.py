"""Which registered workers are live: one rule for the planner (whom it routes to) and the ingress
(whom ``/health`` and admission count), plain bookkeeping with no I/O.

A worker is live while it is registered in etcd under a lease (:func:`bus.registry.watch_workers`
leaves out a key without one) and it has been heard from within ``QUIET_S``: registered, or a
load report (``lw.load.<worker>``, which only that worker may publish). A lease alone says too
little: any etcd user may keep any lease alive, so a frozen worker (SIGSTOP) stayed registered
for as long as someone else refreshed its lease; its load reports stop all the same, and it is
live again as soon as they resume.

Nor is a report proof of a path that serves: a worker behind a congested link (a host slowed to
512 kbit/s in the three-hosts suite) still reports, seconds late, while every token of its
streams and every route to it crawls. A report's delay is its arrival less the time the worker
wrote on it, which holds the two hosts' clock offset as well as the path's delay: so a worker
is late when its reports over the last ``RECENT_S`` all came ``LATE_S`` later than the least
delay it had over ``USUAL_S``, whatever the offset. Late counts as quiet, but for a listener
that finds every worker late: the slow link is then its own, and leaving them all out would
serve nobody.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

# A worker reports its load at least every 0.5 s (LANEWAY_LOAD_REPORT_INTERVAL_S; within 50 ms
# of a request queuing, starting or ending): one silent for four such intervals is taken for
# dead or frozen.
QUIET_S = 2.0
# How much later than usual a worker's reports may come before it counts as quiet: well past a
# loaded event loop's lag (tenths of a second on two cores), well short of a request's patience.
LATE_S = 1.0
# Over how long a worker's usual delay is the least one seen, and its delay now.
USUAL_S = 60.0
RECENT_S = 1.0


class _Least:
    """The least of the values added over the last ``window_s`` (a monotonic queue: each entry
    less than those after it)."""

    __slots__ = ("_queue", "_window_s")

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._queue: deque[tuple[float, float]] = deque()

    def add(self, at: float, value: float) -> None:
        queue = self._queue
        while queue and queue[-1][1] >= value:
            queue.pop()
        queue.append((at, value))
        while queue[0][0] < at - self._window_s:
            queue.popleft()

    @property
    def value(self) -> float:
        return self._queue[0][1]

    @property
    def newest(self) -> float:
        """When the last value was added."""
        return self._queue[-1][0]


class Delays:
    """Delays of what a listener hears from one sender: the least over the last ``RECENT_S``
    (one held behind a long engine step is not a slow path) and the least over ``USUAL_S``."""

    __slots__ = ("_recent", "_usual")

    def __init__(self) -> None:
        self._recent = _Least(RECENT_S)
        self._usual = _Least(USUAL_S)

    def add(self, at: float, delay: float) -> None:
        self._recent.add(at, delay)
        self._usual.add(at, delay)

    @property
    def excess(self) -> float:
        return self._recent.value - self._usual.value

    @property
    def newest(self) -> float:
        """When the last one was heard."""
        return self._recent.newest

    def late(self, now: float) -> bool:
        """Everything heard over the last ``RECENT_S`` came ``LATE_S`` later than usual (and
        something was heard)."""
        return self.newest >= now - RECENT_S and self.excess > LATE_S


class Liveness:
    def __init__(
        self,
        quiet_s: float = QUIET_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._quiet_s = quiet_s
        self._clock = clock
        self._wall = wall
        # Per registered worker, when it was last heard from, on ``clock``.
        self._heard: dict[str, float] = {}
        self._delays: dict[str, Delays] = {}

    def registered(self, workers: Iterable[str]) -> None:
        """The registered set now: a worker new to it counts as heard from now, one gone from it
        is forgotten (a report of its that comes late does not bring it back)."""
        now = self._clock()
        heard = self._heard
        self._heard = {worker: heard.get(worker, now) for worker in workers}
        self._delays = {w: d for w, d in self._delays.items() if w in self._heard}

    def reported(self, worker_id: str, sent_at: float | None = None) -> None:
        """A load report of ``worker_id`` came (one of a worker not registered is ignored);
        ``sent_at``: the wall-clock time the worker wrote on it (seconds since the epoch)."""
        if worker_id not in self._heard:
            return
        now = self._heard[worker_id] = self._clock()
        if sent_at is not None:
            delays = self._delays.get(worker_id)
            if delays is None:
                delays = self._delays[worker_id] = Delays()
            delays.add(now, self._wall() - sent_at)

    def late(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s reports come ``LATE_S`` later than usual, as :meth:`quiet`
        counts it."""
        return worker_id in self._late(self.silent())

    def quiet(self) -> set[str]:
        """Registered workers not heard from for ``QUIET_S``, or whose reports come late."""
        silent = self.silent()
        return silent | self._late(silent)

    def live(self) -> set[str]:
        """Registered workers heard from within ``QUIET_S``, on time."""
        return self._heard.keys() - self.quiet()

    def silent(self) -> set[str]:
        """Registered workers not heard from for ``QUIET_S``: :meth:`quiet` but the late."""
        horizon = self._clock() - self._quiet_s
        return {worker for worker, heard in self._heard.items() if heard < horizon}

    def behind(self) -> bool:
        """Every worker heard is late (two at least, one alone says little): the slow link is
        this listener's own."""
        silent = self.silent()
        heard = self._heard.keys() - silent
        return len(heard) > 1 and heard <= self._late_ones(silent)

    def _late(self, silent: set[str]) -> set[str]:
        late = self._late_ones(silent)
        if not late or self._heard.keys() - silent - late:
            return late
        return set()  # every worker heard is late: the slow link is this listener's

    def _late_ones(self, silent: set[str]) -> set[str]:
        return {w for w, d in self._delays.items() if d.excess > LATE_S and w not in silent}

    @property
    def registered_count(self) -> int:
        return len(self._heard)
