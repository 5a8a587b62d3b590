"""The ingress's ``/health``: whether the cluster behind it can serve a request now. Ready takes
the bus connected, a planner replica consuming requests (its presence key in etcd, which expires
within seconds of its death) and at least one worker registered; otherwise 503 with an
OpenAI-style error naming what is missing.

What etcd says is watched, not read per probe, so that a probe answers at once even while etcd
is away (then the last known planners and workers stand, as they do for routing)."""

from __future__ import annotations

from collections.abc import Callable

import aetcd
import orjson

from bus.registry import PLANNERS_PREFIX, watch_records
from schemas.messages import WorkerRegistration
from services.ingress.errors import ApiError


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
        """Follow the planners' presence keys forever (the keys last seen stand while etcd is
        away)."""
        await watch_records(client, PLANNERS_PREFIX, "planner presence", _pid, self._on_planners)

    async def _on_planners(self, planners: dict[bytes, int]) -> None:
        self.planners = set(planners)


def _pid(key: bytes, value: bytes) -> int:
    return int(value)
