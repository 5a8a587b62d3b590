"""Follow the KV stream into an index: restore the latest snapshot, fold the stream from its
position, track the workers' leases and route the engines without KV events; and know whether
the fold has caught up with the stream.

The kv-indexer process folds it to answer overlap queries; each planner replica may fold it too,
to answer its own without the round trip to the indexer (services/planner/overlaps.py). The
fold reads through a :class:`KvSource` (live, the bus and etcd: :mod:`bus.kv_source`), so that
it knows no broker itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from schemas.events import KvEvent, RouteDecided
from schemas.messages import WorkerRegistration
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.indexer import Indexer

log = logging.getLogger(__name__)


class Snapshots(Protocol):
    async def snapshot(self) -> bytes | None:
        """The latest index snapshot the kv-indexer stored, if any."""
        ...


class KvSource(Snapshots, Protocol):
    """What a fold of the KV stream reads."""

    @property
    def reconnects(self) -> int:
        """How many times the connection was remade: one remade may have missed events."""
        ...

    async def replay(self, after: int, on_kv: Callable[[KvEvent, int], Awaitable[None]]) -> None:
        """Every KV event past stream position ``after``, in order, then live ones, each with
        its position."""
        ...

    async def follow_routes(
        self, worker_id: str, on_route: Callable[[RouteDecided], Awaitable[None]]
    ) -> None:
        """The live routing decisions for ``worker_id`` from now on."""
        ...

    async def watch_workers(
        self, on_workers: Callable[[dict[str, WorkerRegistration]], Awaitable[None]]
    ) -> None:
        """The live workers now and after every change, forever."""
        ...

    async def head(self) -> int:
        """The KV stream's last position; raises while it cannot be told."""
        ...


async def restore(snapshots: Snapshots) -> PrefixIndex:
    data = await snapshots.snapshot()
    if data is None:
        return PrefixIndex()
    index = PrefixIndex.restore(data)
    log.info("restored the index at KV stream position %d (%d blocks)", index.position, index.size)
    return index


class KvFollower:
    """One fold of the KV stream. :meth:`tick`, called every so often (the kv-indexer each
    second, a planner each ``LANEWAY_OVERLAP_CHECK_INTERVAL_S``), does its housekeeping and
    checks how far behind the stream it is: :meth:`current` says whether the fold reached the
    head the last check saw before the next check came (so it is at most one check behind)."""

    def __init__(self, source: KvSource, predicted_ttl_s: float, purge_interval_s: float) -> None:
        self._source = source
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
            await self._source.follow_routes(worker_id, self.indexer.on_route)

        index = await restore(self._source)
        self.indexer = Indexer(index, self._predicted_ttl_s, follow_routes)
        self._position = index.position
        self._watcher = asyncio.create_task(self._source.watch_workers(self.indexer.on_workers))
        await self._source.replay(index.position, self._on_kv)
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
        return self._current and self._source.reconnects == self._reconnects

    async def tick(self, now: float) -> None:
        await self._check()
        # The replay delivers in stream order, so a gap still open now is an event that aged
        # out of the stream (or was lost): waiting for it would stall that worker forever.
        self.indexer.index.skip_gaps()
        if now >= self._next_purge:
            self.indexer.purge_unknown()
            self._next_purge = now + self._purge_interval_s

    async def _check(self) -> None:
        reconnects = self._source.reconnects
        try:
            head = await self._source.head()
        except Exception:  # the source away for a moment: behind until a check succeeds
            log.debug("stream head unknown", exc_info=True)
            self._current = False
            return
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
