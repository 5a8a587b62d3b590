"""The ingress's ``/health``: whether the cluster behind it can serve a request now. Ready takes
the bus connected, a planner replica consuming requests (its presence key in etcd, which expires
within seconds of its death) and at least one live worker (registered under a lease and heard
from lately: services.common.liveness, the planner's rule); otherwise 503 with an OpenAI-style
error naming what is missing.

What etcd says is watched, not read per probe, so that a probe answers at once even while etcd
is away (then the last known planners and workers stand, as they do for routing)."""

from __future__ import annotations

from collections.abc import Callable

import aetcd
import orjson

from bus.registry import PLANNERS_PREFIX, watch_records
from services.common.liveness import QUIET_S, Liveness
from services.ingress.errors import ApiError


class Readiness:
    def __init__(self, bus_connected: Callable[[], bool], liveness: Liveness | None = None) -> None:
        """``liveness``: the workers as the ingress hears of them (fed by its caller)."""
        self._bus_connected = bus_connected
        self._liveness = liveness or Liveness()
        self.planners: set[bytes] = set()

    @property
    def workers(self) -> int:
        """Live workers: a frozen one stops counting within ``QUIET_S``, its lease kept or not."""
        return len(self._liveness.live())

    def missing(self, live: int | None = None) -> list[str]:
        """What keeps the cluster from serving; ``live``: the live workers, counted already."""
        live = self.workers if live is None else live
        gaps = []
        if not self._bus_connected():
            gaps.append("the bus (NATS) is not connected")
        if not self.planners:
            gaps.append("no planner consumes requests")
        if self._liveness.registered_count == 0:
            gaps.append("no worker is registered")
        elif live == 0:
            gaps.append(f"no registered worker reported its load in the last {QUIET_S:g} s")
        return gaps

    def answer(self) -> tuple[int, bytes]:
        """The status and body of ``/health``."""
        live = self.workers
        gaps = self.missing(live)
        if gaps:
            error = ApiError(503, "not ready: " + "; ".join(gaps), code="not_ready")
            return 503, error.body()
        body = {"status": "ok", "planners": len(self.planners), "workers": live}
        return 200, orjson.dumps(body)

    async def watch_planners(self, client: aetcd.Client) -> None:
        """Follow the planners' presence keys forever (the keys last seen stand while etcd is
        away)."""
        await watch_records(
            client, PLANNERS_PREFIX, "planner presence", _pid, self._on_planners, leased=True
        )

    async def _on_planners(self, planners: dict[bytes, int]) -> None:
        self.planners = set(planners)


def _pid(key: bytes, value: bytes) -> int:
    return int(value)
