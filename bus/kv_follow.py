"""Follow the KV stream into an index: restore the latest snapshot, fold the stream from its
position, track the workers' leases and route the engines without KV events; and know whether
the fold has caught up with the stream.

The kv-indexer process folds it to answer overlap queries; each planner replica may fold it too,
to answer its own without the round trip to the indexer (services/planner/overlaps.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aetcd

from bus.client import Bus
from bus.objects import load_object
from bus.registry import watch_workers
from bus.settings import ServiceSettings
from bus.topology import INDEX_SNAPSHOT_NAME, INDEX_SNAPSHOTS, Subjects
from schemas.events import KvEvent, RouteDecided
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.indexer import Indexer

log = logging.getLogger(__name__)


async def restore(bus: Bus) -> PrefixIndex:
    data = await load_object(bus.js, INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME)
    if data is None:
        return PrefixIndex()
    index = PrefixIndex.restore(data)
    log.info("restored the index at KV stream position %d (%d blocks)", index.position, index.size)
    return index


class FoldSettings(ServiceSettings):
    """The fold's settings, the same names for the kv-indexer and the planners: folds of one
    stream with different settings would answer differently."""

    # How often workers without a live lease are swept from the index, seconds.
    purge_interval_s: float = 10.0
    # Approximate mode: how long a routed prompt is assumed cached on an engine without KV events.
    predicted_ttl_s: float = 300.0


class KvFollower:
    """One fold of the KV stream. :meth:`tick`, called every so often (the kv-indexer each
    second, a planner each ``LANEWAY_OVERLAP_CHECK_INTERVAL_S``), does its housekeeping and
    checks how far behind the stream it is: :meth:`current` says whether the fold reached the
    head the last check saw before the next check came (so it is at most one check behind)."""

    def __init__(
        self, bus: Bus, etcd: aetcd.Client, predicted_ttl_s: float, purge_interval_s: float
    ) -> None:
        self._bus = bus
        self._etcd = etcd
        self._predicted_ttl_s = predicted_ttl_s
        self._purge_interval_s = purge_interval_s
        self._next_purge = 0.0
        self._watcher: asyncio.Task[None] | None = None
        self.indexer = Indexer(PrefixIndex())
        # The last stream position delivered, folded or dropped as implausible. A message the
        # replay drops before it (undecodable, its worker not its subject's) leaves it behind
        # until the next event: the fold reads as behind meanwhile, the safe side.
        self._position = 0
        # The stream's head at the last check, while the fold has not reached it yet.
        self._target: int | None = None
        self._current = False
        self._reconnects = -1

    async def start(self) -> Indexer:
        """Restore, then follow the stream and the workers' leases from now on."""

        async def follow_routes(worker_id: str) -> None:
            # Live routing decisions only: predictions are approximate and short-lived anyway.
            await self._bus.subscribe(
                Subjects.route(worker_id).only(RouteDecided), self.indexer.on_route
            )

        index = await restore(self._bus)
        self.indexer = Indexer(index, self._predicted_ttl_s, follow_routes)
        self._position = index.position
        self._watcher = asyncio.create_task(watch_workers(self._etcd, self.indexer.on_workers))
        await self._bus.replay(Subjects.all_kv, index.position, self._on_kv)
        return self.indexer

    async def _on_kv(self, event: KvEvent, position: int) -> None:
        await self.indexer.on_kv(event, position)
        self._position = position
        if self._target is not None and position >= self._target:
            self._target = None
            self._current = True

    def current(self) -> bool:
        # A connection remade since the last check may have missed events the ordered
        # consumer is being restarted for: stale until a check sees the fold reach the head.
        return self._current and self._bus.reconnects == self._reconnects

    async def tick(self, now: float) -> None:
        await self._check()
        # The replay delivers in stream order, so a gap still open now is an event that aged
        # out of the stream (or was lost): waiting for it would stall that worker forever.
        self.indexer.index.skip_gaps()
        if now >= self._next_purge:
            self.indexer.purge_unknown()
            self._next_purge = now + self._purge_interval_s

    async def _check(self) -> None:
        stream = Subjects.all_kv.stream
        assert stream is not None
        reconnects = self._bus.reconnects
        try:
            info = await self._bus.nc.jetstream().stream_info(stream.name)
        except Exception:  # NATS away for a moment: behind until a check succeeds
            log.debug("stream head unknown", exc_info=True)
            self._current = False
            return
        head = info.state.last_seq
        self.indexer.metrics.lag.set(max(0, head - self._position))
        if self._target is not None:  # the head of the check before is not reached yet
            self._current = False
        self._reconnects = reconnects
        if self._position >= head:
            self._target = None
            self._current = True
        else:
            self._target = head

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
