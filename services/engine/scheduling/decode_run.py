"""Many decode steps at once, for a simulation that needs only their times and accounting.

While no request waits and every running one decodes, a step computes one token per request and
its time changes only when a request takes a new block (the KV in use grows). A run does such
steps until one cannot be told apart from what ``schedule`` and ``_advance`` would do without
doing it: a waiting request, a block the pool lacks (preemption), or the step after one that
ends a request. Between block boundaries it does no per-step work beyond adding step times; a
request's tokens are drawn when its next block fills (they are hashed) and at the end.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate, repeat

from services.engine.protocol import KvChange
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.request import SimRequest
from services.engine.scheduling.scheduler import Scheduler

# A step's seconds from its decoding requests and the KV blocks then in use.
StepSeconds = Callable[[int, int], float]
_ALLOC, _FILL = 0, 1


@dataclass(slots=True)
class DecodeRun:
    # When the first step started, then when each step ended.
    times: list[float]
    # The steps' durations in order, as (seconds, steps) for equal consecutive ones.
    durations: list[tuple[float, int]]
    # The batch, in running order: every step gave each of them one token.
    requests: list[SimRequest]
    # Requests the last step ended (at their max_tokens).
    finished: list[SimRequest] = field(default_factory=list)
    # KV changes of every step but the last, and of the last: a step's are published when it ends.
    ended_changes: list[KvChange] = field(default_factory=list)
    last_changes: list[KvChange] = field(default_factory=list)


def decode_run(
    scheduler: Scheduler,
    kv: KvCacheManager,
    step_s: StepSeconds,
    stops: Callable[[SimRequest], frozenset[int]],
    start: float,
    until: float,
) -> DecodeRun | None:
    """Run the decode steps from ``start`` on that begin before ``until`` (at least the first);
    None, with nothing changed, when the first is not such a step."""
    running = scheduler.running
    n = len(running)
    if scheduler.waiting or not n or n > scheduler.max_num_batched_tokens:
        return None
    bs, pool = kv.block_size, kv.pool
    # (step, kind, position in running): the steps where a request takes a block (at the start)
    # or fills one (at the end), each every block_size steps.
    events: list[tuple[int, int, int]] = []
    last = 1 << 62  # the step that ends the first request to reach its max_tokens
    for k, req in enumerate(running):
        c = req.num_computed
        if (
            req.num_tokens - c != 1
            or c < req.prefill_len
            or not req.output
            or req.num_offered != c // bs
            or stops(req)
        ):
            return None
        last = min(last, req.max_tokens - len(req.output))
        events.append((len(req.blocks) * bs - c + 1, _ALLOC, k))
        events.append((bs - c % bs, _FILL, k))
    heapq.heapify(events)
    times, durations = [start], []
    d = step_s(n, pool.num_used)
    done = mark = 0
    applied = [0] * n  # steps already added to each request's state
    while True:
        boundary = min(events[0][0], last)
        plain = boundary - 1 - done
        if plain > 0:
            ends = list(accumulate(repeat(d, plain), initial=times[-1]))
            del ends[0]
            # A step runs if it starts before `until`: the first does, the next at each end.
            steps = 1 + bisect_left(ends, until, 0, plain - 1)
            mark = pool.num_changes if done + steps > 1 else 0
            times += ends[:steps]
            durations.append((d, steps))
            done += steps
            if steps < plain or times[-1] >= until:
                break
        due_alloc: list[int] = []
        due_fill: list[int] = []
        while events and events[0][0] == boundary:
            _, kind, k = heapq.heappop(events)
            (due_alloc if kind == _ALLOC else due_fill).append(k)
        if len(due_alloc) > pool.num_free:
            break  # schedule() preempts here
        mark = pool.num_changes if done else 0
        for k in due_alloc:
            pool.allocate(1)
            running[k].blocks.append(None)
            heapq.heappush(events, (boundary + bs, _ALLOC, k))
        if due_alloc:
            d = step_s(n, pool.num_used)
        times.append(times[-1] + d)
        durations.append((d, 1))
        done += 1
        for k in due_fill:
            _catch_up(running[k], done - applied[k])
            applied[k] = done
            kv.cache_computed(running[k])
            heapq.heappush(events, (boundary + bs, _FILL, k))
        if done == last or times[-1] >= until:
            break
    if not done:
        return None
    for k, req in enumerate(running):
        _catch_up(req, done - applied[k])
    changes = pool.drain_changes()
    finished = [r for r in running if len(r.output) >= r.max_tokens] if done == last else []
    return DecodeRun(times, durations, list(running), finished, changes[:mark], changes[mark:])


def _catch_up(req: SimRequest, steps: int) -> None:
    """``steps`` decode steps of ``req``: each computed one token and sampled the next."""
    if steps:
        req.num_computed += steps
        req.num_tokens += steps
        req.output += req.words.take(steps)
