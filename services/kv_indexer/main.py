"""kv-indexer process: settings, connections, subscriptions."""

from __future__ import annotations

import asyncio
import contextlib

from pydantic import Field

from bus.client import Bus
from bus.registry import connect_etcd, watch_workers
from bus.runtime import run_service
from bus.settings import ServiceSettings
from bus.topology import Subjects, kv_indexer_intake
from schemas.events import new_id
from schemas.messages import OverlapQuery
from services.kv_indexer.handlers import Indexer


class IndexerSettings(ServiceSettings):
    instance_id: str = Field(default_factory=new_id)
    # How often workers without a live lease are swept from the index, seconds.
    purge_interval_s: float = 10.0
    # Approximate mode: how long a routed prompt is assumed cached on an engine without KV events.
    predicted_ttl_s: float = 300.0


def main() -> None:
    settings = IndexerSettings()

    async def serve(stop: asyncio.Event) -> None:
        bus = await Bus.connect(settings.nats_url, f"kv-indexer-{settings.instance_id}")
        await bus.ensure_streams()
        etcd = connect_etcd(settings.etcd_endpoints)
        indexer = Indexer(settings.predicted_ttl_s)
        watcher = asyncio.create_task(watch_workers(etcd, indexer.on_workers))
        # Each replica folds the whole stream into its own index, from the beginning.
        await bus.consume(kv_indexer_intake(settings.instance_id), indexer.on_kv)
        # Live routing decisions only: predictions are approximate and short-lived anyway.
        await bus.subscribe(Subjects.all_routes, indexer.on_route)
        await bus.serve(Subjects.overlap_query, OverlapQuery, indexer.on_query, queue="kv-indexer")
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.purge_interval_s)
            indexer.purge_unknown()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await bus.close()
        await etcd.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
