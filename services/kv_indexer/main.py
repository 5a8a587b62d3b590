"""kv-indexer process: restore the latest snapshot, fold the KV stream from there, answer."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pydantic import Field

from bus.client import Bus
from bus.registry import connect_etcd, watch_workers
from bus.runtime import run_service
from bus.settings import ServiceSettings
from bus.topology import INDEX_SNAPSHOT_NAME, INDEX_SNAPSHOTS, Subjects
from observability.metrics import MetricsServer
from observability.tracing import setup_tracing
from schemas.events import RouteDecided, new_id
from schemas.messages import IndexStateQuery, OverlapQueries, OverlapQuery
from services.kv_indexer.handlers import Indexer
from services.kv_indexer.index import PrefixIndex

log = logging.getLogger(__name__)


class IndexerSettings(ServiceSettings):
    instance_id: str = Field(default_factory=new_id)
    # How often workers without a live lease are swept from the index, seconds.
    purge_interval_s: float = 10.0
    # How often the index is snapshotted, seconds; a restart replays only what came after.
    snapshot_interval_s: float = 30.0
    # Approximate mode: how long a routed prompt is assumed cached on an engine without KV events.
    predicted_ttl_s: float = 300.0


async def _restore(bus: Bus) -> PrefixIndex:
    data = await bus.load_object(INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME)
    if data is None:
        return PrefixIndex()
    index = PrefixIndex.restore(data)
    log.info("restored the index at KV stream position %d (%d blocks)", index.position, index.size)
    return index


async def _lag(bus: Bus, indexer: Indexer) -> None:
    stream = Subjects.all_kv.stream
    assert stream is not None
    info = await bus.nc.jetstream().stream_info(stream.name)
    indexer.metrics.lag.set(max(0, info.state.last_seq - indexer.index.position))


async def _snapshot(bus: Bus, indexer: Indexer) -> None:
    # Replicas share one snapshot name: each is a fold of the same stream, so any is valid.
    position = indexer.index.position
    if position > indexer.snapshotted_at:
        await bus.save_object(
            INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME, indexer.index.snapshot(position)
        )
        indexer.snapshotted_at = position


def main() -> None:
    settings = IndexerSettings()

    async def serve(stop: asyncio.Event) -> None:
        setup_tracing("laneway-kv-indexer", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(settings.nats_url, f"kv-indexer-{settings.instance_id}")
        await bus.ensure_streams(settings.stream_replicas)
        etcd = connect_etcd(settings.etcd_endpoints)

        async def follow_routes(worker_id: str) -> None:
            # Live routing decisions only: predictions are approximate and short-lived anyway.
            await bus.subscribe(Subjects.route(worker_id).only(RouteDecided), indexer.on_route)

        indexer = Indexer(await _restore(bus), settings.predicted_ttl_s, follow_routes)
        watcher = asyncio.create_task(watch_workers(etcd, indexer.on_workers))
        await bus.replay(Subjects.all_kv, indexer.index.position, indexer.on_kv)
        await bus.serve(Subjects.overlap_query, OverlapQuery, indexer.on_query, queue="kv-indexer")
        await bus.serve(
            Subjects.overlap_queries, OverlapQueries, indexer.on_queries, queue="kv-indexer"
        )
        await bus.serve(
            Subjects.index_state(settings.instance_id),
            IndexStateQuery,
            indexer.on_state,
            queue=settings.instance_id,
        )
        metrics = MetricsServer(indexer.metrics.registry)
        await metrics.start(settings.metrics_host, settings.metrics_port)
        metrics.ready_when("bus", lambda: bus.nc.is_connected)
        loop = asyncio.get_running_loop()
        next_purge = next_snapshot = loop.time()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if stop.is_set():  # not one more call to a NATS that may be going away with us
                break
            now = loop.time()
            # The replay delivers in stream order, so a gap still open now is an event that aged
            # out of the stream (or was lost): waiting for it would stall that worker forever.
            indexer.index.skip_gaps()
            try:
                await _lag(bus, indexer)
            except Exception:  # NATS away for a moment: the gauge keeps its last value
                log.debug("stream lag unknown", exc_info=True)
            if now >= next_purge:
                indexer.purge_unknown()
                next_purge = now + settings.purge_interval_s
            if now >= next_snapshot:
                try:
                    await _snapshot(bus, indexer)
                except Exception:  # a missed snapshot only means a longer replay next start
                    log.warning("snapshot failed", exc_info=True)
                next_snapshot = now + settings.snapshot_interval_s
        await metrics.close()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await bus.close()
        await etcd.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
