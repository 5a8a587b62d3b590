"""One followed request's arrivals at the ingress: its placement, its terminals and its token
runs. A run costs a list append as it comes (an engine step's batch holds one for every request
of the ingress on that worker); the runs that queue up meanwhile are joined into one
``TokensGenerated`` when the request's task takes them, so an ingress that falls behind builds
one event per request per turn, not one per request per engine step."""

from __future__ import annotations

import asyncio
from collections import deque

from schemas.deltas import Batch, Run, runs_delta
from services.ingress.follow import Heard

_Run = tuple[Batch, Run]


class Mailbox:
    __slots__ = ("_deadline", "_items", "_timer", "_timer_at", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Heard | _Run] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0  # the waiter's
        # One timer at a time, left armed when an arrival wakes the waiter: a stream waits again
        # at every event, each time with its deadline a little later, and a timer set and
        # cancelled per event was a twentieth of an ingress's CPU per event with 2,000 streams.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, event: Heard) -> None:
        self._items.append(event)
        self._wake()

    def put_run(self, batch: Batch, run: Run) -> None:
        self._items.append((batch, run))
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def arrival(self, deadline: float) -> bool:
        """Waits for something to take, at most until the loop's clock reads ``deadline``;
        whether there is. A timer and a future, not ``asyncio.timeout_at``'s cancellation: with
        2,000 streams that was a tenth of an ingress."""
        if self._items:
            return True
        loop = asyncio.get_running_loop()
        self._deadline = deadline
        if self._timer is None or self._timer_at > deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._arm(loop, deadline)
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # cancelled
                self._waiter = None
        return bool(self._items)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._timer, self._timer_at = loop.call_at(at, self._expire, loop), at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._waiter is None:
            return  # nobody waits now; the next wait sets a timer of its own
        if self._deadline > loop.time():
            self._arm(loop, self._deadline)  # the wait now has a later deadline
            return
        self._wake()

    def get_nowait(self) -> Heard:
        """The next arrival; runs that follow one another (one worker, one attempt, each
        starting where the last ended) come as one event."""
        first = self._items.popleft()
        if not isinstance(first, tuple):
            return first
        batch, run = first
        runs = [run]
        end = run.index + len(run.token_ids)
        items = self._items
        while items and isinstance(following := items[0], tuple):
            other, next_run = following
            if (
                other.worker_id != batch.worker_id
                or next_run.attempt != run.attempt
                or next_run.index != end
            ):
                break
            items.popleft()
            runs.append(next_run)
            end += len(next_run.token_ids)
        return runs_delta(batch, runs)
