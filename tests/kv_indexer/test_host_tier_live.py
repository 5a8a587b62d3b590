"""A live sim worker with a host tier (LANEWAY_HOST_KV_BLOCKS): the blocks its GPU evicts are
published as host-tier KV events, the kv-indexer's overlap answer gives their run, and the
planner routes the prompt that returns knowing the worker holds it there."""

from __future__ import annotations

import openai

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import RequestFinished, RouteDecided
from schemas.messages import OverlapQuery, OverlapReply
from tests.helpers import eventually
from tests.live import ClusterFactory, Observed

MODEL = "laneway-sim"
# 16 GPU blocks of 16 tokens: a second 10-block request evicts part of the first one's.
WORKER = {
    "LANEWAY_BLOCK_SIZE": "16",
    "LANEWAY_NUM_GPU_BLOCKS": "16",
    "LANEWAY_HOST_KV_BLOCKS": "64",
    "LANEWAY_NODE": "n0",
}


async def test_evicted_blocks_reach_the_indexer_and_the_planner_as_host_tier(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1, env=WORKER)
    asker = await Bus.connect(cluster.nats_url, "test-host-tier")
    seen = Observed()
    await asker.subscribe(Subjects.all_routes, seen.on_event)
    await asker.subscribe(Subjects.all_request_terminals, seen.on_event)
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    first, other = "a" * 150, "b" * 150
    try:
        for prompt in (first, other):
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        await eventually(lambda: len(seen.events["RouteDecided"]) == 2)
        route = seen.events["RouteDecided"][0]
        assert isinstance(route, RouteDecided)
        hashes = route.spec.block_hashes
        assert len(hashes) == 9

        async def answer() -> OverlapReply | None:
            query = OverlapQuery(block_hashes=hashes)
            reply = await asker.request(Subjects.overlap_query, query, timeout=2)
            return reply if reply.host_runs else None

        reply = await eventually(answer, timeout=10)
        [worker_id] = reply.host_runs
        gpu = reply.overlaps.get(worker_id, 0)
        # What the GPU no longer holds of the prompt, the host tier does, in a row.
        assert reply.host_runs[worker_id] > 0 and gpu + reply.host_runs[worker_id] == len(hashes)
        await client.completions.create(model=MODEL, prompt=first, max_tokens=4)
        await eventually(lambda: len(seen.events["RouteDecided"]) == 3)
    finally:
        await asker.close()
    again = seen.events["RouteDecided"][2]
    assert isinstance(again, RouteDecided)
    [candidate] = again.candidates
    assert (candidate.cached_blocks, candidate.host_blocks) == (gpu, reply.host_runs[worker_id])
    assert candidate.node == "n0"
    finished = seen.events["RequestFinished"][0]
    assert isinstance(finished, RequestFinished) and finished.worker_id == worker_id
