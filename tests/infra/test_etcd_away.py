"""etcd gone: requests with a session are still routed at once (degraded session ownership),
none waits for etcd to come back."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.live import ClusterFactory


async def test_session_requests_are_served_while_etcd_is_down(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, policy="kv")
    [etcd] = [s for s in cluster.servers if s.name == "etcd"]
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=10
    ) as http:

        async def turn(user: str) -> float:
            started = time.monotonic()
            body = {"model": "laneway-sim", "prompt": f"hi from {user}", "max_tokens": 4}
            reply = await http.post("/completions", json={**body, "user": user})
            assert reply.status_code == 200, reply.text
            return time.monotonic() - started

        await asyncio.gather(*(turn(f"user-{i}") for i in range(4)))  # bound while etcd is up
        etcd.kill()
        try:
            # Known sessions and new ones; the first calls find etcd gone (a bounded wait).
            took = await asyncio.gather(*(turn(f"user-{i}") for i in range(8)))
            again = await asyncio.gather(*(turn(f"user-{i}") for i in range(8)))
        finally:
            etcd.restart()
    assert max(took) < 3.0, took
    assert max(again) < 1.0, again
