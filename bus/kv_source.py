"""The KV stream as a fold reads it live (:class:`services.common.kv_follow.KvSource`): the
snapshot in the object store, the stream and the routes on NATS, the workers' leases in etcd;
and the fold's settings, shared by the kv-indexer and the planners."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aetcd

from bus.client import Bus
from bus.objects import load_object
from bus.registry import watch_workers
from bus.settings import ServiceSettings
from bus.topology import INDEX_SNAPSHOT_NAME, INDEX_SNAPSHOTS, Subjects
from schemas.events import KvEvent, RouteDecided
from schemas.messages import WorkerRegistration


class FoldSettings(ServiceSettings):
    """The fold's settings, the same names for the kv-indexer and the planners: folds of one
    stream with different settings would answer differently."""

    # How often workers without a live lease are swept from the index, seconds.
    purge_interval_s: float = 10.0
    # Approximate mode: how long a routed prompt is assumed cached on an engine without KV events.
    predicted_ttl_s: float = 300.0


class BusSnapshots:
    """The kv-indexer's snapshots of the index, in the object store."""

    def __init__(self, bus: Bus) -> None:
        self._bus = bus

    async def snapshot(self) -> bytes | None:
        return await load_object(self._bus.js, INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME)


class BusKvSource(BusSnapshots):
    def __init__(self, bus: Bus, etcd: aetcd.Client) -> None:
        super().__init__(bus)
        self._etcd = etcd

    @property
    def reconnects(self) -> int:
        return self._bus.reconnects

    async def replay(self, after: int, on_kv: Callable[[KvEvent, int], Awaitable[None]]) -> None:
        await self._bus.replay(Subjects.all_kv, after, on_kv)

    async def follow_routes(
        self, worker_id: str, on_route: Callable[[RouteDecided], Awaitable[None]]
    ) -> None:
        await self._bus.subscribe(Subjects.route(worker_id).only(RouteDecided), on_route)

    async def watch_workers(
        self, on_workers: Callable[[dict[str, WorkerRegistration]], Awaitable[None]]
    ) -> None:
        await watch_workers(self._etcd, on_workers)

    async def head(self) -> int:
        stream = Subjects.all_kv.stream
        assert stream is not None
        info = await self._bus.nc.jetstream().stream_info(stream.name)
        return info.state.last_seq
