"""A request that moved to another worker, as the planner books and records it, pure: each
attempt has a route of its own (a late event of an earlier one changes nothing), and a migrated
decision, recorded as one, still replays to what ``decide()`` gives."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.events import WorkerLoadReported
from schemas.messages import WorkerRegistration
from services.planner.cluster import ClusterView, Routed, decided_reason, migrated_reason
from services.planner.kv_policy import KvAware
from services.planner.policy import RouteRequest
from services.planner.replay import differences, redecide
from tests.helpers import registration as small
from tests.planner.recorded import DISAGG, recorded


def registration(worker_id: str) -> WorkerRegistration:
    return small(worker_id).model_copy(update={"kv_blocks_total": 64, "max_num_seqs": 8})


def in_flight(cluster: ClusterView) -> dict[str, int]:
    return {view.worker_id: view.in_flight for view in cluster.candidates()}


def test_each_attempt_of_a_request_is_routed_once() -> None:
    cluster = ClusterView()
    cluster.set_workers({w: registration(w) for w in ("a", "b")})
    cluster.routed("r", Routed("a", "i", None), 10, 0.0)
    assert cluster.is_routed("r") and not cluster.is_routed("r", attempt=1)
    cluster.routed("r", Routed("b", "i", None, attempt=1), 10, 0.0)
    assert in_flight(cluster) == {"a": 0, "b": 1}
    # A redelivered earlier attempt, and the old worker's late terminal, leave the new route.
    assert cluster.is_routed("r", attempt=0)
    cluster.finished("r", "a")
    assert cluster.is_routed("r", attempt=1) and in_flight(cluster) == {"a": 0, "b": 1}
    cluster.finished("r", "b")
    assert not cluster.is_routed("r") and in_flight(cluster) == {"a": 0, "b": 0}


def test_a_lost_worker_gives_back_its_routes_with_their_attempts() -> None:
    cluster = ClusterView()
    cluster.set_workers({w: registration(w) for w in ("a", "b")})
    cluster.report(
        WorkerLoadReported(
            source="worker/a",
            worker_id="a",
            role="both",
            running=1,
            waiting=0,
            waiting_prefill_tokens=0,
            kv_blocks_used=1,
            kv_blocks_total=64,
            occurred_at=datetime.now(UTC),
        )
    )
    cluster.routed("r", Routed("a", "i", "s", attempt=2), 10, 0.0)
    lost = cluster.set_workers({"b": registration("b")})
    assert lost == {"r": Routed("a", "i", "s", attempt=2)}
    assert not cluster.is_routed("r", attempt=2)


def test_a_migrated_decision_replays_to_the_decision_it_was() -> None:
    event = recorded(KvAware())
    moved = event.model_copy(
        update={
            "spec": event.spec.model_copy(update={"attempt": 2}),
            "reason": migrated_reason(2, event.reason),
        }
    )
    assert moved.reason.startswith("migrated (attempt 2): ")
    assert decided_reason(moved.reason, 2) == event.reason
    assert migrated_reason(0, event.reason) == event.reason
    assert differences(moved, redecide(moved, KvAware(), DISAGG)) == []


def test_an_attempt_avoids_the_workers_its_request_left_while_another_can_take_it() -> None:
    cluster = ClusterView()
    cluster.set_workers({w: registration(w) for w in ("a", "b", "c")})
    request = RouteRequest("r", 32, (1, 2))

    def weighed(avoid: frozenset[str]) -> set[str]:
        inputs = cluster.decision_inputs(request, None, None, avoid=avoid)
        return {view.worker_id for view in inputs.decoders}

    assert weighed(frozenset()) == {"a", "b", "c"}
    assert weighed(frozenset({"a", "b"})) == {"c"}
    # Where no other can take it, the workers it left are weighed again: better than none.
    cluster.set_workers({"a": registration("a")})
    assert weighed(frozenset({"a"})) == {"a"}


def test_the_ingress_avoiding_what_the_planner_hears_on_time_wins_over_its_hearing_late() -> None:
    """A planner behind a slow link hears its neighbours on time and every other worker late;
    the ingress, the other way round. The answer's tokens go to the ingress: its word wins."""
    cluster = ClusterView()
    cluster.set_workers({w: registration(w) for w in ("near", "far")})
    request = RouteRequest("r", 32, (1, 2))
    cluster.liveness.late = lambda worker: worker == "far"  # type: ignore[method-assign]
    cluster.liveness.quiet = lambda: {"far"}  # type: ignore[method-assign]

    def weighed(avoid: frozenset[str]) -> set[str]:
        inputs = cluster.decision_inputs(request, None, None, avoid=avoid)
        return {view.worker_id for view in inputs.decoders}

    assert weighed(frozenset()) == {"near"}
    assert weighed(frozenset({"near"})) == {"far"}
    # A worker this planner has not heard from at all is still left out.
    cluster.liveness.silent = lambda: {"far"}  # type: ignore[method-assign]
    assert weighed(frozenset({"near"})) == {"near"}
