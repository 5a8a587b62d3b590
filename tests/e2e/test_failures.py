"""Failures the cluster works around: an engine without KV events is indexed from its routing
decisions. (A worker killed outright: tests/e2e/test_migration.py.)"""

from __future__ import annotations

import openai

from bus.client import Bus
from bus.topology import Subjects
from tests.live import ClusterFactory, api_block_hashes

MODEL = "laneway-sim"


async def test_engines_without_kv_events_are_indexed_from_routing(
    cluster_factory: ClusterFactory,
) -> None:
    from infra.bench.traces import block_tokens
    from schemas.messages import OverlapQuery

    cluster = cluster_factory(workers=2, env={"LANEWAY_KV_EVENTS": "false"})
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    prompt = block_tokens(42, 160).decode()
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    hashes = await api_block_hashes(cluster, list(prompt.encode()), 16)
    bus = await Bus.connect(cluster.nats_url, "test-approx")
    answer = await bus.request(Subjects.overlap_query, OverlapQuery(block_hashes=hashes), timeout=2)
    await bus.close()
    assert list(answer.overlaps.values()) == [10]
    assert answer.indexed_blocks == 0  # nothing came from KV events
