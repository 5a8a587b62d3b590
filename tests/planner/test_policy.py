from __future__ import annotations

from collections import Counter

import pytest

from services.planner.policy import RouteRequest, WorkerView
from services.planner.policy_registry import make_policy

REQ = RouteRequest("r", 100, ())


def views(*loads: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", load, 0, 0.0, 0) for i, load in enumerate(loads)]


def test_round_robin_cycles_through_all_workers() -> None:
    policy = make_policy("round_robin")
    picks = [policy.choose(REQ, views(5, 0, 9)).worker_id for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_picks_the_idlest_and_rotates_ties() -> None:
    policy = make_policy("least_loaded")
    assert policy.choose(REQ, views(3, 1, 2)).worker_id == "w1"
    picks = Counter(policy.choose(REQ, views(0, 0)).worker_id for _ in range(4))
    assert picks == {"w0": 2, "w1": 2}


def test_least_loaded_counts_its_own_in_flight_requests() -> None:
    stale = [WorkerView("a", 0, 0, 0.0, in_flight=4), WorkerView("b", 1, 0, 0.0, in_flight=1)]
    choice = make_policy("least_loaded").choose(REQ, stale)
    assert choice.worker_id == "b"
    assert choice.costs == {"a": 4.0, "b": 1.0}


def test_random_is_reproducible_for_a_seed() -> None:
    p, q = make_policy("random", 7), make_policy("random", 7)
    assert [p.choose(REQ, views(0, 0, 0)).worker_id for _ in range(20)] == [
        q.choose(REQ, views(0, 0, 0)).worker_id for _ in range(20)
    ]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
