"""LoRA adapters in the planner's view of its workers: a request with an adapter is offered only
workers that hold adapters; what each will hold when it runs is its last report's adapters,
then those routed there since, each used in turn and the least recently used dropped beyond its
max_loras, until a later report says otherwise; the loads those make are counted ahead of it."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.events import WorkerLoadReported
from services.planner.adapters import adapters_ahead
from services.planner.cluster import ClusterView, Routed
from services.planner.policy import RouteRequest
from tests.helpers import load_report, registration

ADAPTER = RouteRequest(request_id="r", prompt_tokens=32, block_hashes=(1, 2), lora="ad-1")


def workers(max_loras: dict[str, int]) -> ClusterView:
    cluster = ClusterView(lambda: 0.0)
    cluster.set_workers(
        {w: registration(w).model_copy(update={"max_loras": n}) for w, n in max_loras.items()}
    )
    return cluster


def held(cluster: ClusterView, request: RouteRequest = ADAPTER) -> dict[str, frozenset[str]]:
    return {v.worker_id: v.loras for v in cluster.decision_inputs(request, None, None).decoders}


def loads_ahead(cluster: ClusterView) -> dict[str, int]:
    views = cluster.decision_inputs(ADAPTER, None, None).decoders
    return {v.worker_id: v.lora_loads_ahead for v in views}


def test_adapters_ahead_follow_the_lru() -> None:
    assert adapters_ahead(("a", "b"), (), 2) == (frozenset({"a", "b"}), 0)
    # c evicts a (least recently used), then a loads again and evicts b.
    assert adapters_ahead(("a", "b"), ("c", "a"), 2) == (frozenset({"c", "a"}), 2)
    # b used first is the most recent: c evicts a instead.
    assert adapters_ahead(("a", "b"), ("b", "c", "b"), 2) == (frozenset({"b", "c"}), 1)
    assert adapters_ahead((), ("x", "x", "y"), 3) == (frozenset({"x", "y"}), 2)


def report(worker_id: str, loras: tuple[str, ...], at: float) -> WorkerLoadReported:
    return load_report(worker_id).model_copy(
        update={"loras": loras, "occurred_at": datetime.fromtimestamp(at, UTC)}
    )


def test_an_adapters_request_is_offered_only_workers_that_hold_adapters() -> None:
    cluster = workers({"w1": 2, "w2": 0, "w3": 1})
    assert sorted(held(cluster)) == ["w1", "w3"]
    base = RouteRequest(request_id="b", prompt_tokens=32, block_hashes=(1, 2))
    assert sorted(held(cluster, base)) == ["w1", "w2", "w3"]
    # None of them: no candidate, and the planner fails the request as it does a missing pool.
    assert held(workers({"w1": 0})) == {}


def test_held_adapters_are_the_reports_and_the_routes_since() -> None:
    cluster = workers({"w1": 2, "w2": 2})
    cluster.report(report("w1", ("ad-1", "ad-2"), at=100.0))
    assert held(cluster) == {"w1": frozenset({"ad-1", "ad-2"}), "w2": frozenset()}
    cluster.routed("r", Routed("w2", "ingress", None), 32, now=101.0, lora="ad-3")
    assert held(cluster)["w2"] == {"ad-3"}
    assert loads_ahead(cluster) == {"w1": 0, "w2": 1}
    # Routed to w1, which holds two: ad-3 evicts ad-1, its least recently used.
    cluster.routed("s", Routed("w1", "ingress", None), 32, now=101.0, lora="ad-3")
    assert held(cluster)["w1"] == {"ad-2", "ad-3"}
    # A report from before the route leaves it; one after it replaces it.
    cluster.report(report("w2", (), at=100.5))
    assert held(cluster)["w2"] == {"ad-3"}
    cluster.report(report("w2", ("ad-4",), at=102.0))
    assert held(cluster)["w2"] == {"ad-4"}
    assert loads_ahead(cluster)["w2"] == 0


def test_a_remote_prefill_loads_the_adapter_on_both_workers() -> None:
    cluster = workers({"w1": 2, "w2": 2})
    cluster.routed("r", Routed("w1", "ingress", None), 32, now=1.0, prefill_worker="w2", lora="x")
    assert held(cluster) == {"w1": frozenset({"x"}), "w2": frozenset({"x"})}
