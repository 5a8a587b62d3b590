"""The kv-indexer killed mid-replay and restarted holds the index a never-restarted one holds."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from nats.errors import NoRespondersError

from bus.client import Bus
from infra.bench.live_replay import replay_live
from infra.bench.traces import load_trace
from schemas.messages import IndexState
from tests.helpers import eventually
from tests.kv_indexer.helpers import index_state
from tests.live import ClusterFactory


async def test_restarted_indexer_equals_the_one_that_never_stopped(
    cluster_factory: ClusterFactory, small_trace: Path
) -> None:
    cluster = cluster_factory(
        workers=2,
        indexers=2,
        env={
            "LANEWAY_BLOCK_SIZE": "64",
            "LANEWAY_NUM_GPU_BLOCKS": "256",  # small: evictions too, not only stores
            "LANEWAY_SNAPSHOT_INTERVAL_S": "0.5",
        },
    )
    bus = await Bus.connect(cluster.nats_url, "test-restart")

    async def indexed() -> int:
        return (await index_state(bus, "indexer-0")).indexed_blocks

    async def caught_up() -> tuple[IndexState, IndexState] | None:
        try:
            restarted = await index_state(bus, "indexer-0")
            steady = await index_state(bus, "indexer-1")
        except NoRespondersError:  # the restarted one still starting (a loaded machine)
            return None
        return (restarted, steady) if restarted.position == steady.position else None

    replay = asyncio.create_task(
        replay_live(
            load_trace(small_trace, speedup=4),
            cluster.config.base_url,
            cluster.nats_url,
            "laneway-sim",
            block_size=64,
            headers=cluster.api_headers,
        )
    )
    await eventually(indexed, timeout=30, interval=0.2)
    await asyncio.sleep(1.5)  # a snapshot with something in it
    victim = cluster.service("kv-indexer-0")
    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    await asyncio.sleep(0.5)  # events keep flowing while it is down
    cluster.spawn(victim)

    result = await replay
    assert result.report["completed"] == 12
    restarted, steady = await eventually(caught_up, message="the restarted indexer never caught up")
    await bus.close()
    assert restarted.restored_from > 0  # it resumed from a snapshot, not from scratch
    assert restarted.indexed_blocks == steady.indexed_blocks > 0
    assert restarted.digest == steady.digest
    assert restarted.blocks_per_worker == steady.blocks_per_worker
    assert sum(steady.blocks_per_worker.values()) == steady.indexed_blocks
