"""The ingress's /health is the cluster's readiness: 200 with a planner and workers behind a
connected bus, else 503 naming what is missing."""

from __future__ import annotations

import httpx
import pytest

from services.common.liveness import QUIET_S, Liveness
from services.ingress.health import Readiness
from tests.helpers import eventually
from tests.live import ClusterFactory


def test_each_missing_part_is_named_in_one_openai_error() -> None:
    readiness = Readiness(lambda: False)
    status, body = readiness.answer()
    error = httpx.Response(status, content=body).json()["error"]
    assert status == 503
    assert error["code"] == "not_ready"
    assert error["type"] == "service_unavailable_error"
    assert error["message"] == (
        "not ready: the bus (NATS) is not connected; no planner consumes requests; "
        "no worker is registered"
    )


def test_a_registered_worker_counts_while_it_reports_its_load() -> None:
    """The planner's rule (services.common.liveness): registered under a lease and heard from
    within QUIET_S. A frozen worker whose lease someone else keeps alive stops counting."""
    now = [0.0]
    liveness = Liveness(clock=lambda: now[0])
    readiness = Readiness(lambda: True, liveness)
    readiness.planners = {b"p"}
    liveness.registered(["a", "b"])
    assert readiness.answer() == (200, b'{"status":"ok","planners":1,"workers":2}')
    now[0] = QUIET_S + 1
    liveness.reported("b")
    liveness.reported("ghost")  # not registered: not counted however often it reports
    assert readiness.workers == 1
    now[0] = 2 * QUIET_S + 2
    status, body = readiness.answer()
    message = httpx.Response(status, content=body).json()["error"]["message"]
    assert (status, message) == (
        503,
        f"not ready: no registered worker reported its load in the last {QUIET_S:g} s",
    )
    liveness.reported("a")  # it runs again
    assert readiness.workers == 1


@pytest.mark.live
async def test_health_follows_the_planner(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2, env={"LANEWAY_LEASE_TTL_S": "2"})
    root = cluster.config.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, headers=cluster.api_headers, timeout=5) as http:
        ready = await http.get("/health")
        assert (ready.status_code, ready.json()) == (
            200,
            {"status": "ok", "planners": 1, "workers": 2},
        )
        planner = cluster.service("planner").proc
        assert planner is not None
        planner.kill()
        planner.wait()

        async def unready() -> httpx.Response | None:
            reply = await http.get("/health")
            return reply if reply.status_code == 503 else None

        # The planner's presence key goes with its lease (5 s).
        gone = await eventually(unready, timeout=15)
    assert gone.json()["error"]["message"] == "not ready: no planner consumes requests"
