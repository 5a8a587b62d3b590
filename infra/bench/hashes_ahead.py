"""A trace's prompt block hashes, worked out by a helper process ahead of the replay.

Hashing the made-up prompts of the Mooncake trace is a sixth of an offline replay's time, and no
routing decision depends on it: a second core can do it while the first simulates. Results are
the same as :meth:`PromptFactory.block_hashes` by construction (it is what the helper calls), and
a request whose chunk the helper has not finished yet is hashed here instead, so the replay never
waits for the helper and runs unchanged, only slower, where there is no second core or no helper.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from infra.bench.traces import PromptFactory, TraceRequest

# Requests per task: few enough to be ahead of the replay soon.
CHUNK = 512
# Below this many requests the helper's start costs more than it saves.
MIN_REQUESTS = 4096

# What the helper hashes: set before it forks, so that it has the trace without a copy of it
# pickled through a pipe (by a thread of the replay's process, which the replay would wait for).
_work: tuple[Sequence[TraceRequest], PromptFactory] | None = None


def _hash_range(start: int, stop: int) -> list[tuple[int, ...]]:
    assert _work is not None
    trace, factory = _work
    return [factory.block_hashes(r) for r in trace[start:stop]]


class HashesAhead:
    """``of(i)``: the block hashes of ``trace[i]`` from ``prompts``, hashed ahead where a helper
    process runs (traces of ``min_requests`` or more, where processes fork); ``close`` stops
    the helper."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        prompts: PromptFactory,
        min_requests: int = MIN_REQUESTS,
        chunk: int = CHUNK,
    ) -> None:
        global _work
        self._trace = trace
        self._prompts = prompts
        self._chunk = chunk
        self._done: dict[int, list[tuple[int, ...]]] = {}
        self._futures: list[Future[list[tuple[int, ...]]]] = []
        self._pool: ProcessPoolExecutor | None = None
        if len(trace) < min_requests or "fork" not in multiprocessing.get_all_start_methods():
            return
        _work = (trace, prompts)  # the helper's copy, its memo its own
        try:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
            # The first submit forks the helper, with `_work` as it is now.
            self._futures = [
                self._pool.submit(_hash_range, start, start + chunk)
                for start in range(0, len(trace), chunk)
            ]
        finally:
            _work = None

    def of(self, i: int) -> tuple[int, ...]:
        k, at = divmod(i, self._chunk)
        done = self._done.get(k)
        if done is None and k < len(self._futures):
            future = self._futures[k]
            # A helper that failed (killed, say) leaves the work here, where it is done anyway.
            if future.done() and future.exception() is None:
                done = self._done[k] = future.result()
        if done is None:
            return self._prompts.block_hashes(self._trace[i])
        return done[at]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
