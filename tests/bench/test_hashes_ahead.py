"""Hashes from the helper process are the factory's own, and its failure costs nothing but time."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchmarks.sim_digest import digest
from infra.bench import hashes_ahead, offline
from infra.bench.hashes_ahead import HashesAhead
from infra.bench.offline import OfflineReplay
from infra.bench.traces import PromptFactory, TraceRequest, load_trace
from services.engine.sim import SimConfig
from services.planner.policy_registry import make_policy


def _settled(ahead: HashesAhead) -> None:
    """Until the helper has finished every chunk (or failed)."""
    deadline = time.monotonic() + 30
    while not all(f.done() for f in ahead._futures) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_helper_hashes_are_the_factorys(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    ahead = HashesAhead(trace, PromptFactory(16), min_requests=0, chunk=5)
    try:
        _settled(ahead)
        assert ahead._done == {}  # nothing taken yet: every hash below comes from the helper
        reference = PromptFactory(16)
        # Out of order too: a replay asks in arrival order, which need not be the trace's.
        for i in reversed(range(len(trace))):
            assert ahead.of(i) == reference.block_hashes(trace[i])
        assert len(ahead._done) == -(-len(trace) // 5)
    finally:
        ahead.close()


def _stuck(start: int, stop: int) -> list[tuple[int, ...]]:
    time.sleep(60)
    return []


def test_a_killed_helper_leaves_the_hashing_here(
    small_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = load_trace(small_trace)
    monkeypatch.setattr(hashes_ahead, "_hash_range", _stuck)  # killed before it hashes any
    ahead = HashesAhead(trace, PromptFactory(16), min_requests=0, chunk=1)
    try:
        pool = ahead._pool
        assert pool is not None
        for pid in list(pool._processes):
            os.kill(pid, signal.SIGKILL)
        _settled(ahead)
        assert all(f.exception() is not None for f in ahead._futures)
        reference = PromptFactory(16)
        assert [ahead.of(i) for i in range(len(trace))] == [
            reference.block_hashes(r) for r in trace
        ]
    finally:
        ahead.close()


def test_small_traces_start_no_helper(small_trace: Path) -> None:
    ahead = HashesAhead(load_trace(small_trace), PromptFactory(16))
    assert ahead._pool is None and ahead._futures == []


def test_a_replay_with_the_helper_is_the_replay_without(
    small_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def replay() -> str:
        result = OfflineReplay(load_trace(small_trace), make_policy("kv", 0), 2, SimConfig()).run()
        return digest(result)

    def settled_ahead(trace: Sequence[TraceRequest], prompts: PromptFactory) -> HashesAhead:
        ahead = HashesAhead(trace, prompts, min_requests=0, chunk=3)
        _settled(ahead)
        return ahead

    alone = replay()
    monkeypatch.setattr(offline, "HashesAhead", settled_ahead)
    assert replay() == alone
