"""Admission control through the real services: a burst past the cluster's room is answered
429 with Retry-After, and every request admitted completes whole. Marked slow: the overload
benchmark (benchmarks/admission_bench.py) and its acceptance figures."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import httpx
import pytest

from benchmarks.admission_bench import BenchConfig, run
from tests.e2e.exact import stream_body
from tests.live import ClusterFactory

WORKERS, SLOTS = 2, 2


async def test_a_burst_past_the_clusters_room_is_shed_and_the_rest_complete(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=WORKERS, env={"LANEWAY_MAX_NUM_SEQS": str(SLOTS)})
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30.0
    ) as http:

        async def one(seed: int) -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            body = {**stream_body(seed, 32), "ignore_eos": True}
            response = await http.post("/completions", json=body)
            return response, time.perf_counter() - started

        replies = await asyncio.gather(*(one(seed) for seed in range(40)))
        metrics = (await http.get(cluster.config.base_url.removesuffix("/v1") + "/metrics")).text
    statuses = [r.status_code for r, _ in replies]
    assert set(statuses) <= {200, 429}, statuses
    ok = [r for r, _ in replies if r.status_code == 200]
    shed = [(r, s) for r, s in replies if r.status_code == 429]
    assert len(ok) >= WORKERS * SLOTS
    assert shed, "40 at once on 4 slots, and none was shed"
    for response in ok:
        assert response.text.endswith("data: [DONE]\n\n")
    for response, seconds in shed:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_overloaded"
        # 100 ms on an idle host (the benchmark); a loaded test machine gets some slack.
        assert seconds < 1.0
    assert f"laneway_ingress_admission_capacity {float(WORKERS * SLOTS)}" in metrics
    assert 'laneway_ingress_shed_total{priority="normal",reason=' in metrics


@pytest.mark.slow
def test_at_four_times_capacity_admitted_requests_keep_their_ttft() -> None:
    figures = run(BenchConfig())
    unloaded, _, overload = cast(list[dict[str, Any]], figures["phases"])
    assert overload["shed_429"] > 0
    assert overload["errors_5xx"] == overload["no_answer"] == overload["incomplete_streams"] == 0
    assert overload["other_status"] == 0
    assert overload["ttft_p95_ms"] <= 2 * unloaded["ttft_p95_ms"], figures
    assert overload["shed_p95_ms"] < 100, figures
