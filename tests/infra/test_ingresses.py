"""Several ingress processes on one API port: the kernel spreads the connections over them, each
serves its own, and the port stays served while one of them is gone."""

from __future__ import annotations

import os
import signal

import httpx

from infra.cluster import LocalCluster
from tests.live import ClusterFactory


async def _complete_each_on_a_new_connection(cluster: LocalCluster, count: int) -> None:
    body = {"model": "laneway-sim", "prompt": "hello there", "max_tokens": 2, "stream": True}
    # No connection kept: each request is a new connection the kernel hands to either process.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, limits=limits, timeout=30.0
    ) as http:
        for _ in range(count):
            async with http.stream("POST", "/completions", json=body) as reply:
                assert reply.status_code == 200
                lines = [line async for line in reply.aiter_lines() if line.startswith("data:")]
            assert lines[-1] == "data: [DONE]"


def _completed(cluster: LocalCluster, name: str) -> float:
    port = cluster.service(name).metrics_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("laneway_ingress_requests_total{") and 'status="200"' in line
    )


async def test_two_ingresses_share_the_port_and_outlive_each_other(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1, ingresses=2)
    assert [s.name for s in cluster.ingresses()] == ["ingress-0", "ingress-1"]
    await _complete_each_on_a_new_connection(cluster, 40)
    served = {name: _completed(cluster, name) for name in ("ingress-0", "ingress-1")}
    # 40 connections hashed over two listeners: each took some (all to one: 2 in 10^12).
    assert sum(served.values()) == 40 and all(n > 0 for n in served.values()), served
    victim = cluster.service("ingress-0")
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    await _complete_each_on_a_new_connection(cluster, 10)
    assert _completed(cluster, "ingress-1") == served["ingress-1"] + 10
