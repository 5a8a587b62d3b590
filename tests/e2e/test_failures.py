"""A worker killed outright: the planner stops routing to it once its lease expires, and what was
in flight there ends with an error, never a hang."""

from __future__ import annotations

import os
import signal
import time

import openai

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import Event, RequestFailed, RouteDecided
from tests.helpers import eventually
from tests.live import ClusterFactory, registrations

MODEL = "laneway-sim"


async def test_killed_worker_fails_its_requests_and_gets_no_more(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2)
    bus = await Bus.connect(cluster.nats_url, "test-observer")
    routes: list[RouteDecided] = []
    failures: list[RequestFailed] = []

    async def observe(event: Event) -> None:
        if isinstance(event, RouteDecided):
            routes.append(event)
        elif isinstance(event, RequestFailed):
            failures.append(event)

    await bus.subscribe(Subjects.all_routes, observe)
    await bus.subscribe(Subjects.all_request_terminals, observe)
    workers = await registrations(cluster.etcd_endpoints)
    client = openai.AsyncOpenAI(base_url=cluster.config.base_url, api_key="x", max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt="a long one", max_tokens=4000, stream=True
    )
    await anext(aiter(stream))
    victim = routes[-1].worker_id
    os.kill(workers[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()

    try:
        async for _chunk in stream:
            pass
        raise AssertionError("the stream of a killed worker ended without an error")
    except openai.APIError as err:
        assert "worker" in str(err.message)
    waited = time.monotonic() - killed_at
    assert waited < 10, f"the client waited {waited:.1f}s for the failure"
    # Our own subscription may hear of it a moment after the client did.
    await eventually(lambda: failures, timeout=2)
    assert [f.code for f in failures] == ["worker_lost"]

    routes.clear()
    survivors = set(workers) - {victim}
    for i in range(4):
        reply = await client.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
    assert {r.worker_id for r in routes} == survivors
    await bus.close()


async def test_engines_without_kv_events_are_indexed_from_routing(
    cluster_factory: ClusterFactory,
) -> None:
    from infra.bench.traces import block_tokens
    from schemas.block_hash import chain_block_hashes
    from schemas.messages import OverlapQuery, OverlapReply

    cluster = cluster_factory(workers=2, env={"LANEWAY_KV_EVENTS": "false"})
    client = openai.AsyncOpenAI(base_url=cluster.config.base_url, api_key="x", max_retries=0)
    prompt = block_tokens(42, 160).decode()
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    hashes = chain_block_hashes(list(prompt.encode()), 16)
    bus = await Bus.connect(cluster.nats_url, "test-approx")
    answer = await bus.request(
        Subjects.overlap_query, OverlapQuery(block_hashes=hashes), OverlapReply, timeout=2
    )
    await bus.close()
    assert list(answer.overlaps.values()) == [10]
    assert answer.indexed_blocks == 0  # nothing came from KV events
