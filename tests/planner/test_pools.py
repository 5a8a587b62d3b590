"""Model pools in the planner's view: a request's candidates are the workers of its model, a
silent pool is not offered while another is heard, and workers that name no model of their own
serve any for one release (with a warning), as before pools."""

from __future__ import annotations

import logging

import pytest

from schemas.messages import DEFAULT_MODEL
from services.common.liveness import QUIET_S
from services.planner.cluster import ClusterView
from services.planner.policy import RouteRequest
from tests.helpers import load_report, registration

REQUEST = RouteRequest(request_id="r", prompt_tokens=32, block_hashes=(1, 2))


def pools(models: dict[str, str]) -> tuple[ClusterView, list[float]]:
    now = [0.0]
    cluster = ClusterView(lambda: now[0])
    cluster.set_workers(
        {w: registration(w).model_copy(update={"model": m}) for w, m in models.items()}
    )
    return cluster, now


def offered(cluster: ClusterView, model: str) -> list[str]:
    inputs = cluster.decision_inputs(REQUEST, None, None, model=model)
    return [v.worker_id for v in inputs.decoders]


def test_a_request_is_offered_its_models_workers_only() -> None:
    cluster, _ = pools({"a1": "alpha", "a2": "alpha", "b1": "beta"})
    assert offered(cluster, "alpha") == ["a1", "a2"]
    assert offered(cluster, "beta") == ["b1"]
    assert offered(cluster, "gamma") == []


def test_a_silent_pool_is_not_offered_while_another_is_heard() -> None:
    cluster, now = pools({"a1": "alpha", "b1": "beta"})
    now[0] = QUIET_S + 1
    cluster.report(load_report("b1"))
    # alpha's one worker is silent, beta's is heard: no stall of the bus, alpha's worker is
    # down; a request routed there would wait for a migration.
    assert offered(cluster, "alpha") == []
    # Every worker silent: the bus or this planner stalled, and routing beats refusing.
    now[0] = 2 * QUIET_S + 2
    assert offered(cluster, "alpha") == ["a1"]


def test_workers_of_no_model_of_their_own_serve_any_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster, _ = pools({"w1": DEFAULT_MODEL, "w2": DEFAULT_MODEL})
    with caplog.at_level(logging.WARNING):
        assert offered(cluster, "llama") == ["w1", "w2"]
        assert offered(cluster, "llama") == ["w1", "w2"]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "set LANEWAY_MODEL=llama on them (this goes in the next release)" in warning
    # Once a worker names a model, the pools are the operator's: no worker of llama, none.
    cluster, _ = pools({"w1": DEFAULT_MODEL, "w2": "mistral"})
    assert offered(cluster, "llama") == []
