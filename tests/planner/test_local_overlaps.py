"""The planner's own fold of the KV stream (services/common/kv_follow.py) answers its overlaps:
the same answers as the kv-indexer's on the same stream, restored from the indexer's snapshot and
replayed on, rebuilt by a restarted planner, one per replica, and the indexer asked instead while
the fold is behind the stream."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from bus.client import Bus
from bus.kv_source import BusKvSource, BusSnapshots
from bus.provision import ensure_streams
from bus.registry import LeasedKey, connect_etcd
from bus.topology import KV, Subjects
from infra.bench.live_replay import replay_live
from infra.bench.traces import load_trace
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer
from schemas.events import KvBlocksStored, KvEvent, RouteDecided, new_id
from schemas.messages import (
    IndexStateQuery,
    OverlapQueries,
    OverlapReplies,
    OverlapReply,
)
from services.common.kv_follow import KvFollower, restore
from services.planner.overlaps import Overlaps
from tests.helpers import eventually, registration
from tests.kv_indexer.helpers import index_state
from tests.live import ClusterFactory, admin_nats, api_block_hashes, observe
from tests.planner.helpers import asker, indexer

BLOCK = 16
# 64 blocks of 16 tokens (the sim's tokenizer: a token a byte), shared by every request below.
PREFIX = "".join(f"a shared prefix, line {i:03d}. " for i in range(40))[: 64 * BLOCK]


def _answers() -> Counter:
    return Counter("answers", "", ["source"], registry=CollectorRegistry())


async def _caught_up(follower: KvFollower) -> bool:
    await follower.tick(asyncio.get_running_loop().time())
    return follower.current()


@pytest.fixture
async def follower(bus: Bus, etcd_server: EmbeddedServer) -> AsyncIterator[KvFollower]:
    etcd = connect_etcd(etcd_server.url)
    found = KvFollower(BusKvSource(bus, etcd), predicted_ttl_s=300.0, purge_interval_s=10.0)
    yield found
    await found.close()
    await etcd.close()


async def test_a_fold_behind_the_stream_asks_the_indexer(
    bus: Bus, follower: KvFollower, etcd_server: EmbeddedServer
) -> None:
    def from_indexer(batch: OverlapQueries) -> OverlapReplies:
        reply = OverlapReply(overlaps={"asked": 1}, indexed_blocks=1)
        return OverlapReplies(replies=(reply,) * len(batch.queries))

    await indexer(bus, from_indexer)
    worker, hashes = f"w{new_id()[:12]}", tuple(random.getrandbits(63) for _ in range(3))
    etcd = connect_etcd(etcd_server.url)
    lease = LeasedKey.worker(etcd, registration(worker), ttl_s=10)
    await lease.start()

    async def stored(seq: int, blocks: tuple[int, ...]) -> None:
        event = KvBlocksStored(source="t", worker_id=worker, seq=seq, block_hashes=blocks)
        await bus.publish(Subjects.kv(worker), event)

    await stored(1, hashes[:2])
    await follower.start()
    overlaps = Overlaps(asker(bus)[0], follower, _answers())
    # Not checked against the stream's head yet: the indexer answers.
    assert await overlaps.ask(hashes) == ({"asked": 1}, {})
    await eventually(lambda: _caught_up(follower), message="the fold never caught up")
    assert await overlaps.ask(hashes) == ({worker: 2}, {})

    # The fold stalls (a busy planner) while the stream goes on: two checks later it is behind.
    gate = asyncio.Event()
    fold = follower.indexer.on_kv

    async def held(event: KvEvent, position: int) -> None:
        await gate.wait()
        await fold(event, position)

    follower.indexer.on_kv = held  # type: ignore[method-assign]
    head = (await bus.nc.jetstream().stream_info(KV.name)).state.last_seq
    await stored(2, hashes[2:])
    await eventually(lambda: _has(bus, head + 1), message="the event never reached the stream")
    loop = asyncio.get_running_loop()
    await follower.tick(loop.time())
    await follower.tick(loop.time())
    assert not follower.current()
    assert await overlaps.ask(hashes) == ({"asked": 1}, {})
    gate.set()  # it catches up on the event it held: its own answer again, with that event
    await eventually(follower.current, message="the fold never caught up again")
    assert await overlaps.ask(hashes) == ({worker: 3}, {})
    await lease.stop()
    await etcd.close()


async def test_a_fold_reads_as_behind_after_a_reconnect_until_a_check(
    tmp_path: Path, etcd_server: EmbeddedServer
) -> None:
    """Events may have gone by while the connection was away: a check must see the fold at the
    stream's head before its answers count again."""
    server = admin_nats(ClusterAuth(tmp_path / "auth", []), tmp_path / "nats")
    etcd = connect_etcd(etcd_server.url)
    try:
        bus = await Bus.connect(server.url, "test-reconnect")
        await ensure_streams(bus.js)
        follower = KvFollower(BusKvSource(bus, etcd), predicted_ttl_s=300.0, purge_interval_s=10.0)
        await follower.start()
        await eventually(lambda: _caught_up(follower), message="the fold never caught up")
        reconnects = bus.reconnects
        server.kill()
        server.restart()
        await eventually(lambda: bus.reconnects > reconnects, timeout=20, message="no reconnect")
        assert not follower.current()
        await eventually(lambda: _caught_up(follower), message="the fold never caught up again")
        await follower.close()
        await bus.close()
    finally:
        server.stop()
        await etcd.close()


async def test_the_planners_fold_answers_as_the_indexer_does_restored_or_not(
    cluster_factory: ClusterFactory, small_trace: Path
) -> None:
    """A fold that followed the stream from the start and one restored from the indexer's
    snapshot later hold the indexer's index and answer each prompt as it does."""
    cluster = cluster_factory(
        workers=2,
        env={
            "LANEWAY_BLOCK_SIZE": "64",
            "LANEWAY_NUM_GPU_BLOCKS": "256",  # small: evictions too, not only stores
            "LANEWAY_SNAPSHOT_INTERVAL_S": "0.5",
        },
    )
    bus, seen = await observe(cluster.nats_url)
    etcd = connect_etcd(cluster.etcd_endpoints)
    from_start = KvFollower(BusKvSource(bus, etcd), predicted_ttl_s=300.0, purge_interval_s=10.0)
    await from_start.start()
    trace = load_trace(small_trace, speedup=4)
    result = await replay_live(
        trace,
        cluster.config.base_url,
        cluster.nats_url,
        "laneway-sim",
        block_size=64,
        headers=cluster.api_headers,
    )
    assert result.report["completed"] == 12
    await asyncio.sleep(1.0)  # the last KV events folded, and snapshotted every 0.5 s
    indexed = await index_state(bus, "indexer-0")
    assert indexed.indexed_blocks > 0
    await eventually(lambda: _snapshot_at(bus, indexed.position), message="no snapshot")
    restored = KvFollower(BusKvSource(bus, etcd), predicted_ttl_s=300.0, purge_interval_s=10.0)
    await restored.start()
    assert restored.indexer.restored_from == indexed.position > 0
    # The prompts the planner asked about, each one's answer from both.
    routes = seen.events["RouteDecided"]
    prompts = [e.spec.block_hashes for e in routes if isinstance(e, RouteDecided)]
    assert len(prompts) == 12 and all(prompts)
    asked, _ = asker(bus)
    for follower in (from_start, restored):
        await eventually(lambda f=follower: _caught_up(f), message="a fold never caught up")
        state = await follower.indexer.on_state(IndexStateQuery())
        assert (state.position, state.digest) == (indexed.position, indexed.digest)
        assert state.blocks_per_worker == indexed.blocks_per_worker
        local = Overlaps(asked, follower, _answers())
        answers = [await local.ask(blocks) for blocks in prompts]
        assert answers == [await asked.ask(blocks) for blocks in prompts]
        assert any(gpu for gpu, _ in answers)  # some prompt is cached somewhere
    for follower in (from_start, restored):
        await follower.close()
    await etcd.close()
    await bus.close()


async def _snapshot_at(bus: Bus, position: int) -> bool:
    return (await restore(BusSnapshots(bus))).position == position


async def test_kv_events_reach_each_replicas_routing_with_no_indexer_and_after_a_restart(
    cluster_factory: ClusterFactory,
) -> None:
    """No kv-indexer runs: only the planners' own folds know where a prefix is cached. Requests
    sharing it go to the worker holding it, from both replicas, and from a replica killed and
    started again (its fold rebuilt from the stream)."""
    cluster = cluster_factory(workers=2, indexers=0, planners=2)
    bus, seen = await observe(cluster.nats_url)
    hashes = await api_block_hashes(cluster, list(PREFIX.encode()), BLOCK)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30.0
    ) as http:

        async def routed(text: str) -> RouteDecided:
            body = {"model": "laneway-sim", "prompt": text, "max_tokens": 1}
            reply = (await http.post("/completions", json=body)).raise_for_status().json()
            request_id = reply["id"].removeprefix("cmpl-")
            return await eventually(
                lambda: next(iter(seen.of(RouteDecided, request_id)), None),
                message="no route seen",
            )

        async def sources_routed_cached(count: int) -> set[str]:
            """The replicas that routed some of ``count`` requests on the prefix to its owner,
            seeing it cached there."""
            found = set()
            for n in range(count):
                route = await routed(f"{PREFIX} question {n}")
                cached = {c.worker_id: c.cached_blocks for c in route.candidates}
                if route.worker_id == owner and cached[owner] == len(hashes):
                    found.add(route.source)
            return found

        owner = (await routed(PREFIX)).worker_id
        # Both replicas (each takes requests from the one durable consumer) fold on their own.
        both = await eventually(
            lambda: _both(sources_routed_cached(8)), message="a replica never saw the prefix"
        )
        victim = cluster.service("planner-0")
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        cluster.spawn(victim)
        # A new instance id: three sources once the restarted one routes by its rebuilt fold.
        await eventually(
            lambda: _grown(both, sources_routed_cached(8)),
            timeout=30,
            message="the restarted planner never saw the prefix",
        )
    await bus.close()


async def _both(sources: Awaitable[set[str]]) -> set[str] | None:
    found = await sources
    return found if len(found) == 2 else None


async def _grown(known: set[str], sources: Awaitable[set[str]]) -> bool:
    return bool(await sources - known)


async def _has(bus: Bus, position: int) -> bool:
    """The KV stream holds ``position`` (a stored publish is not waited for)."""
    return (await bus.nc.jetstream().stream_info(KV.name)).state.last_seq >= position
