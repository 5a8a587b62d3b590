"""The planner's cluster view offers routing only workers it still hears from."""

from __future__ import annotations

from schemas.events import Role
from services.common.liveness import QUIET_S
from services.planner.cluster import ClusterView
from services.planner.policy import RouteRequest
from tests.helpers import load_report, registration

REQUEST = RouteRequest(request_id="r", prompt_tokens=32, block_hashes=(1, 2))


def view(roles: dict[str, Role]) -> tuple[ClusterView, list[float]]:
    now = [0.0]
    cluster = ClusterView(lambda: now[0])
    cluster.set_workers(
        {
            w: registration(w).model_copy(update={"role": role, "kv_handoff": True})
            for w, role in roles.items()
        }
    )
    return cluster, now


def heard(cluster: ClusterView, worker_id: str, role: Role) -> None:
    cluster.report(load_report(worker_id, role=role))


def offered(cluster: ClusterView) -> tuple[list[str], list[str]]:
    inputs = cluster.decision_inputs(REQUEST, None, None)
    return [v.worker_id for v in inputs.decoders], [v.worker_id for v in inputs.prefillers]


def test_a_worker_gone_silent_is_not_offered_while_others_are_heard() -> None:
    cluster, now = view({"a": "both", "b": "both", "p": "prefill", "q": "prefill"})
    assert offered(cluster) == (["a", "b"], ["p", "q"])
    now[0] = QUIET_S + 1  # a and p were killed: their leases stand, but they say nothing
    heard(cluster, "b", "both")
    heard(cluster, "q", "prefill")
    assert offered(cluster) == (["b"], ["q"])
    heard(cluster, "a", "both")  # only slow: offered again
    assert offered(cluster) == (["a", "b"], ["q"])


def test_when_every_server_is_silent_they_are_all_still_offered_but_silent_prefillers_not() -> None:
    cluster, now = view({"a": "both", "b": "both", "p": "prefill"})
    now[0] = QUIET_S + 1  # the bus (or this planner) stalled: nothing was heard from anyone
    # Refusing every request would be worse than a route that may need a migration; a prompt
    # is prefilled on its decode worker rather than sent to a prefill worker that may be dead.
    assert offered(cluster) == (["a", "b"], [])
