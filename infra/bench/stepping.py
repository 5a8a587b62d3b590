"""How an offline replay's workers step, and what the end of each step records.

Time advances from event to event. Where no worker's step has an effect beyond that worker until
the next arrival (no prefill pool, no capacity loop), workers are not stepped in one global
order: before each arrival every worker catches up to it on its own, its plain decode steps many
at a time (:meth:`SimEngine.decode_run`), and what their ends change that depends on order (the
output length predictor's lessons) waits to be applied in time order. The figures equal those of
stepping every worker in one global order, which the other configurations still do.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cmp_to_key, reduce
from itertools import chain, groupby, pairwise, repeat
from operator import add
from typing import Any

from infra.bench.metrics import RequestRecord
from infra.bench.sim_worker import SimWorker
from infra.bench.tiers import OutputLengths
from infra.bench.traces import TraceRequest
from schemas.latency import LatencyHistogram
from services.common.kv_index.changes import CLEARED, Change, change_of
from services.common.kv_index.index import PrefixIndex
from services.common.token_times import gaps_ms
from services.engine.protocol import (
    BlocksStored,
    CacheCleared,
    KvChange,
    RequestOutput,
    StepResult,
)
from services.engine.scheduling.decode_run import DecodeRun

STEP_END = 1
# Suffix of the id a request has on the prefill worker that computes its prompt.
PREFILL = "/prefill"


class ReplaySteps(ABC):
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        workers: list[SimWorker],
        lengths: OutputLengths,
        watch_gaps: bool,
    ) -> None:
        """``watch_gaps``: keep the token gaps since the capacity loop last looked."""
        self._trace = trace
        self._workers = workers
        self._lengths = lengths
        self._index = PrefixIndex()
        self._records = [RequestRecord(r.arrival_s, r.input_length) for r in trace]
        # Token gaps since the capacity loop last looked, bucketed as the live loop gets them,
        # and how many of them waited on a prefill in the same step.
        self._watch_gaps = watch_gaps
        self._interval_gaps = LatencyHistogram()
        self._interval_stalled = 0
        # Engine request id -> request number.
        self._owner: dict[str, int] = {}
        self._events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._position = {w.worker_id: k for k, w in enumerate(workers)}
        # False: every worker steps in one global event order, as catching up must equal.
        self.catch_up = True
        # Whether workers catch up this run: not where a step's end can reach past its worker
        # (a hand-off, a role switch, the capacity loop's look).
        self._catching_up = False
        # The next event's time: how far a worker may step ahead of the others.
        self._until = math.inf
        # Finished requests the predictor learns from once everyone caught up: (time, worker,
        # its step, request number).
        self._lessons: list[tuple[float, int, int, int]] = []
        # (worker, step) -> the order of the steps begun when their worker was idle: by an
        # arrival, in the order arrivals at one time are taken.
        self._idle_starts: dict[tuple[int, int], int] = {}

    @abstractmethod
    def _hand_off(self, now: float, prefill: SimWorker, i: int, output: RequestOutput) -> None:
        """A prefill worker sampled request ``i``'s first token."""

    @abstractmethod
    def _switch(self, now: float, worker: SimWorker) -> None:
        """``worker``, idle, takes the role the capacity loop moved it to."""

    def _push(self, at: float, kind: int, who: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, who, payload))

    def _start_step(self, now: float, worker: SimWorker, w: int) -> None:
        if self._catching_up:
            run = worker.engine.decode_run(now, self._until)
            if run is not None:
                self._start_run(worker, run)
                return
        result = worker.engine.step()
        if result.duration_s <= 0 and not result.outputs:
            self._fold(worker, result.kv_changes)
            worker.stepping = False  # nothing could be scheduled: wait for the next arrival
            return
        worker.stepping = True
        end = now + result.duration_s
        busy = worker.record.busy
        if busy.last_end() != now:
            self._idle_starts[w, len(busy)] = len(self._idle_starts)
        busy.append((now, end))
        worker.busy_in_role += result.duration_s
        if self._catching_up:
            worker.end, worker.pending = end, result
        else:
            self._push(end, STEP_END, w, result)

    def _catch_up(self, until: float) -> float:
        """Every worker's steps that end before ``until``, and the predictor's lessons from them;
        the last of their ends."""
        self._until = until
        last = 0.0
        for w, worker in enumerate(self._workers):
            while worker.stepping and worker.end < until:
                now, pending = worker.end, worker.pending
                last = max(last, now)
                if isinstance(pending, StepResult):
                    self._step_end(now, worker, w, pending)
                else:
                    self._run_end(now, worker, w, pending)
        self._learn()
        return last

    def _start_run(self, worker: SimWorker, run: DecodeRun) -> None:
        """Account a decode run's steps: those before its last have ended already."""
        times = run.times
        worker.stepping = True
        worker.record.busy.chain(times)
        steps = chain.from_iterable(repeat(d, n) for d, n in run.durations)
        worker.busy_in_role = reduce(add, steps, worker.busy_in_role)
        self._fold(worker, run.ended_changes)
        records = [self._records[self._owner[r.request_id]] for r in run.requests]
        ended = len(times) - 2
        if ended:
            # Every request of the batch got each step's token: the gaps after the first agree.
            later = gaps_ms(times[1:-1])
            first, last = times[1], times[-2]
            for record in records:
                record.times.came_in_steps(first, later, last)
                record.output_tokens += ended
        worker.end, worker.pending = times[-1], (run, records)

    def _run_end(
        self, now: float, worker: SimWorker, w: int, pending: tuple[DecodeRun, list[RequestRecord]]
    ) -> None:
        run, records = pending
        self._fold(worker, run.last_changes)
        for record in records:
            record.times.came(now)
            record.output_tokens += 1
        for req in run.finished:
            i = self._owner.pop(req.request_id)
            worker.in_flight -= 1
            self._finished(now, i, worker)
        self._next_step(now, worker, w)

    def _step_end(self, now: float, worker: SimWorker, w: int, result: StepResult) -> None:
        # A live worker publishes a step's KV events when the step is done; so does this.
        self._fold(worker, result.kv_changes)
        stalled = result.prefill_tokens > 0
        for output in result.outputs:
            i = self._owner[output.request_id]
            prefilled = output.request_id.endswith(PREFILL)
            if not prefilled:
                self._stream(now, i, output, stalled)
            if output.finished:
                del self._owner[output.request_id]
                worker.in_flight -= 1
                if prefilled:
                    self._hand_off(now, worker, i, output)
                else:
                    self._finished(now, i, worker)
        self._next_step(now, worker, w)

    def _next_step(self, now: float, worker: SimWorker, w: int) -> None:
        worker.stepping = False
        if worker.engine.has_work():
            self._start_step(now, worker, w)
        elif worker.next_role is not None and worker.in_flight == 0:
            self._switch(now, worker)

    def _finished(self, now: float, i: int, worker: SimWorker) -> None:
        """Request ``i``'s last token was streamed from ``worker`` at ``now``."""
        worker.routed -= 1
        if self._catching_up and self._lengths.learns:
            step = len(worker.record.busy) - 1
            self._lessons.append((now, self._position[worker.worker_id], step, i))
        else:
            self._lengths.finished(i, self._trace[i].input_length, self._records[i].output_tokens)

    def _learn(self) -> None:
        """The predictor learns what finished while workers caught up, in the order stepping in
        one global order would have: by time, a worker's own in its order."""
        lessons = self._lessons
        if not lessons:
            return
        lessons.sort(key=lambda lesson: lesson[0])  # stable: a worker's own stay in order
        if any(a[0] == b[0] and a[1] != b[1] for a, b in pairwise(lessons)):
            lessons.sort(key=cmp_to_key(self._earlier))
        for *_, i in lessons:
            self._lengths.finished(i, self._trace[i].input_length, self._records[i].output_tokens)
        lessons.clear()

    def _earlier(self, a: tuple[float, int, int, int], b: tuple[float, int, int, int]) -> int:
        """-1 if lesson ``a``'s step ended first in a global order, 1 if ``b``'s (each is (end,
        worker, step, request)). At equal ends the step whose start came first did: a start at
        a step's end follows from that end, ties going back along both workers' steps; a start
        when idle follows from an arrival, which comes before any step's end at its time."""
        if a[0] != b[0] or a[1] == b[1]:
            return -1 if (a[0], a[2]) < (b[0], b[2]) else 1
        busy_a, busy_b = self._workers[a[1]].record.busy, self._workers[b[1]].record.busy
        k, m = a[2], b[2]
        while True:
            start, other = busy_a[k][0], busy_b[m][0]
            if start != other:
                return -1 if start < other else 1
            chained_a = k > 0 and busy_a[k - 1][1] == start
            chained_b = m > 0 and busy_b[m - 1][1] == start
            if chained_a != chained_b:
                return 1 if chained_a else -1
            if not chained_a:
                # Both started by arrivals at one time: the earlier arrival's step, whose end
                # one global event order scheduled first.
                first = self._idle_starts[a[1], k] < self._idle_starts[b[1], m]
                return -1 if first else 1
            k, m = k - 1, m - 1

    def _stream(self, now: float, i: int, output: RequestOutput, stalled: bool) -> None:
        """Request ``i``'s output into its record, as its live worker streams it (every token
        at once: times and gaps)."""
        record = self._records[i]
        ids = output.new_token_ids
        if record.times.first_s is None:
            record.cached_tokens = output.cached_tokens or 0
        elif not ids:
            return
        gap = record.times.came(now)
        if gap is not None and self._watch_gaps:
            self._interval_gaps.add(gap)
            self._interval_stalled += stalled
        record.output_tokens += len(ids)

    def _fold(self, worker: SimWorker, changes: list[KvChange]) -> None:
        # The index folds the step's changes as the live one folds a worker's step event, but
        # without the event built, and changes of one kind and tier in a row as one (a step
        # evicts for each request it admits, one after the other; a run's steps store a block
        # per request each): the same index in fewer calls.
        if not changes:
            return
        folded: list[Change] = []
        for (stored, tier), group in groupby(changes, _fold_key):
            if stored is None:
                folded += [(CLEARED, ())] * sum(1 for _ in group)
                continue
            runs = [c.block_hashes for c in group if not isinstance(c, CacheCleared)]
            hashes = runs[0] if len(runs) == 1 else tuple(chain.from_iterable(runs))
            folded.append(change_of(stored, tier, hashes))
        worker.kv_seq += 1
        self._index.apply_changes(worker.worker_id, worker.kv_seq, tuple(folded))


def _fold_key(change: KvChange) -> tuple[bool | None, str]:
    """Whether ``change`` stores blocks (None: it clears the cache), and its tier."""
    if isinstance(change, CacheCleared):
        return None, ""
    return isinstance(change, BlocksStored), change.tier
