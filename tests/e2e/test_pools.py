"""Model pools in one cluster (`laneway up --pool alpha=2 --pool beta=2`): the API lists every
pool's model, each answers, a model no pool serves is refused as OpenAI refuses it, and every
request is served by a worker of its own model's pool."""

from __future__ import annotations

import asyncio

import httpx

from schemas.events import RequestFinished
from tests.helpers import eventually
from tests.live import ClusterFactory, observe, registrations

POOLS = {"alpha": 2, "beta": 2}
PER_MODEL = 12


async def test_each_pools_requests_reach_only_its_workers(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(pools=POOLS)
    workers = await registrations(cluster.etcd_endpoints)
    assert sorted(reg.model for reg in workers.values()) == ["alpha", "alpha", "beta", "beta"]
    bus, seen = await observe(cluster.nats_url)
    headers = cluster.api_headers
    try:
        async with httpx.AsyncClient(
            base_url=cluster.config.base_url, headers=headers, timeout=30
        ) as http:
            listed = (await http.get("/models")).json()
            assert sorted(m["id"] for m in listed["data"]) == ["alpha", "beta"]
            assert (await http.get("/models/beta")).json()["id"] == "beta"

            refused = await http.post(
                "/completions", json={"model": "gamma", "prompt": "hi", "max_tokens": 2}
            )
            assert refused.status_code == 404
            assert refused.json()["error"]["code"] == "model_not_found"

            async def one(model: str, i: int) -> tuple[str, str]:
                body = {"model": model, "prompt": f"pool request {i}", "max_tokens": 4}
                reply = await http.post("/completions", json=body)
                assert reply.status_code == 200, reply.text
                answer = reply.json()
                assert answer["model"] == model and answer["usage"]["completion_tokens"] == 4
                return model, answer["id"].removeprefix("cmpl-")

            sent = await asyncio.gather(
                *(one(model, i) for model in POOLS for i in range(PER_MODEL))
            )

        def finished() -> dict[str, RequestFinished] | None:
            ends = {rid: seen.of(RequestFinished, rid) for _, rid in sent}
            if not all(ends.values()):
                return None
            return {rid: end[0] for rid, end in ends.items()}  # type: ignore[misc]

        ends = await eventually(finished, timeout=10)
        served = {model: set() for model in POOLS}
        for model, request_id in sent:
            worker = workers[ends[request_id].worker_id]
            assert worker.model == model, (request_id, model, worker.model)
            served[model].add(worker.worker_id)
        # Each pool's two workers both served (the planner spreads load within a pool).
        assert all(len(ids) == 2 for ids in served.values()), served
    finally:
        await bus.close()
