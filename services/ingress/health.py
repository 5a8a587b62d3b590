"""The ingress's ``/health``: whether the cluster behind it can serve a request now. Ready takes
the bus connected, a planner replica consuming requests (its presence key in etcd, which expires
within seconds of its death) and at least one worker registered; otherwise 503 with an
OpenAI-style error naming what is missing.

What etcd says is watched, not read per probe, so that a probe answers at once even while etcd
is away (then the last known planners and workers stand, as they do for routing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd
import orjson

from bus.registry import PLANNERS_PREFIX
from schemas.messages import WorkerRegistration
from services.ingress.errors import ApiError

log = logging.getLogger(__name__)


class Readiness:
    def __init__(self, bus_connected: Callable[[], bool]) -> None:
        self._bus_connected = bus_connected
        self.planners: set[bytes] = set()
        self.workers = 0

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        self.workers = len(workers)

    def missing(self) -> list[str]:
        gaps = []
        if not self._bus_connected():
            gaps.append("the bus (NATS) is not connected")
        if not self.planners:
            gaps.append("no planner consumes requests")
        if self.workers == 0:
            gaps.append("no worker is registered")
        return gaps

    def answer(self) -> tuple[int, bytes]:
        """The status and body of ``/health``."""
        gaps = self.missing()
        if gaps:
            error = ApiError(503, "not ready: " + "; ".join(gaps), code="not_ready")
            return 503, error.body()
        body = {"status": "ok", "planners": len(self.planners), "workers": self.workers}
        return 200, orjson.dumps(body)

    async def watch_planners(self, client: aetcd.Client) -> None:
        """Follow the planners' presence keys forever; a broken watch is set up again from a
        fresh read (etcd restarting), the keys last seen standing meanwhile."""
        while True:
            try:
                await self._watch_once(client)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("planner watch broke; re-reading from etcd", exc_info=True)
                await asyncio.sleep(1.0)

    async def _watch_once(self, client: aetcd.Client) -> None:
        snapshot = await client.get_prefix(PLANNERS_PREFIX, keys_only=True)
        self.planners = {kv.key for kv in snapshot}
        start = snapshot.header.revision + 1
        async for event in await client.watch_prefix(PLANNERS_PREFIX, start_revision=start):
            if event.kind == aetcd.EventKind.PUT:
                self.planners.add(event.kv.key)
            else:
                self.planners.discard(event.kv.key)
