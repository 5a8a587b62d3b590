"""Urgency in the kv policy's cost: the priority class and a TTFT target weigh waiting on the
KV's owner, moving the KV and recomputing it alike, so an urgent request moves for a gain a
normal one waits out, and a low one waits where a normal one moves."""

from __future__ import annotations

import dataclasses

from services.planner.decision import Decision, DecisionInputs, decide
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.policy import Priority, RouteRequest, WorkerView

BLOCKS = 512  # 8,192 tokens at block size 16


def _decide(priority: Priority, queued: int, **settings: float) -> Decision:
    """The KV's owner ``a`` caches the whole prompt behind ``queued`` prompt tokens; ``b``, on
    the same node, is idle and caches nothing."""
    request = RouteRequest("r", BLOCKS * 16, tuple(range(BLOCKS)), None, 100, None, priority)
    idle = WorkerView("b", running=0, waiting=0, kv_usage=0.0, in_flight=0, node="n0")
    owner = dataclasses.replace(
        idle, worker_id="a", cached_blocks=BLOCKS, waiting_prefill_tokens=queued
    )
    policy = KvAware(KvSettings(moves=True, **settings))  # type: ignore[arg-type]
    inputs = DecisionInputs(request, [owner, idle], handoff=frozenset({"a", "b"}))
    return decide(policy, DisaggSettings(mode="never"), inputs)


def test_a_high_priority_request_moves_kv_a_normal_one_waits_for() -> None:
    # About 49 ms on the owner against 20 ms after the move: under the 50 ms margin...
    normal = _decide("normal", queued=2000)
    assert (normal.worker_id, normal.kv_move) == ("a", None)
    # ...which twice the weight on each ms of waiting clears.
    high = _decide("high", queued=2000)
    assert high.worker_id == "b" and high.kv_move is not None
    assert high.kv_move.source_worker_id == "a"
    # The alternatives explained are the raw predictions, not the weighted costs.
    owner = next(a for a in high.kv_move.alternatives if a.action == "owner")
    assert 40 < owner.predicted_ttft_ms < 60


def test_a_low_priority_request_waits_where_a_normal_one_moves() -> None:
    assert _decide("normal", queued=4000).kv_move is not None
    low = _decide("low", queued=4000)
    assert (low.worker_id, low.kv_move) == ("a", None)


def test_a_ttft_target_the_owner_would_miss_turns_waiting_into_a_move() -> None:
    assert _decide("normal", queued=2000, ttft_target_ms=0.0).kv_move is None
    missed = _decide("normal", queued=2000, ttft_target_ms=30.0)
    assert missed.worker_id == "b" and missed.kv_move is not None
    # A target both meet changes nothing.
    assert _decide("normal", queued=2000, ttft_target_ms=500.0).kv_move is None


def test_a_normal_request_on_target_costs_what_it_did() -> None:
    plain = _decide("normal", queued=8000, high_priority_weight=3.0, low_priority_weight=0.1)
    assert plain.candidates == _decide("normal", queued=8000).candidates
