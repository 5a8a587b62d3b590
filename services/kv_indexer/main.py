"""kv-indexer process: restore the latest snapshot, fold the KV stream from there, answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pydantic import Field

from bus.client import Bus
from bus.kv_source import BusKvSource, FoldSettings
from bus.objects import save_object
from bus.registry import connect_etcd
from bus.runtime import run_service
from bus.topology import INDEX_SNAPSHOT_NAME, INDEX_SNAPSHOTS, Subjects
from observability.metrics import MetricsServer
from observability.tracing import setup_tracing
from schemas.events import new_id
from services.common.kv_follow import KvFollower
from services.common.kv_index.indexer import Indexer

log = logging.getLogger(__name__)


class IndexerSettings(FoldSettings):
    instance_id: str = Field(default_factory=new_id)
    # How often the index is snapshotted, seconds; a restart replays only what came after.
    snapshot_interval_s: float = 30.0


async def _snapshot(bus: Bus, indexer: Indexer) -> None:
    # Replicas share one snapshot name: each is a fold of the same stream, so any is valid.
    position = indexer.index.position
    if position > indexer.snapshotted_at:
        await save_object(
            bus.js, INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME, indexer.index.snapshot(position)
        )
        indexer.snapshotted_at = position


def main() -> None:
    settings = IndexerSettings()

    async def serve(stop: asyncio.Event) -> None:
        setup_tracing("laneway-kv-indexer", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(settings.nats_url, f"kv-indexer-{settings.instance_id}")
        await bus.provision(settings.stream_replicas, settings.bus_provisioned)
        etcd = connect_etcd(settings.etcd_endpoints)
        source = BusKvSource(bus, etcd)
        follower = KvFollower(source, settings.predicted_ttl_s, settings.purge_interval_s)
        indexer = await follower.start()
        await bus.serve(Subjects.overlap_query, indexer.on_query, queue="kv-indexer")
        await bus.serve(Subjects.overlap_queries, indexer.on_queries, queue="kv-indexer")
        await bus.serve(
            Subjects.index_state(settings.instance_id), indexer.on_state, queue=settings.instance_id
        )
        metrics = MetricsServer(indexer.metrics.registry)
        await metrics.start(settings.metrics_host, settings.metrics_port)
        metrics.ready_when("bus", lambda: bus.nc.is_connected)
        loop = asyncio.get_running_loop()
        next_snapshot = loop.time()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():  # not one more call to a NATS that may be going away with us
                break
            now = loop.time()
            await follower.tick(now)
            if now >= next_snapshot:
                try:
                    await _snapshot(bus, indexer)
                except Exception:  # a missed snapshot only means a longer replay next start
                    log.warning("snapshot failed", exc_info=True)
                next_snapshot = now + settings.snapshot_interval_s
        await metrics.close()
        await follower.close()
        await bus.close()
        await etcd.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
