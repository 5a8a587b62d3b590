"""A running cluster's queues as its services' ``/metrics`` show them, sampled over a benchmark:
where a request waits (the ingress's admission queue, a worker's engine queue), how full the
workers' KV is, and how fast they really step (generated tokens and engine-busy seconds per
wall second)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

# Per service kind: the series kept, by their name in the exposition text (labels included).
_KEPT = {
    "ingress": {
        "laneway_ingress_requests_in_flight": "in_flight",
        "laneway_ingress_admission_queue_depth": "admission_queue",
        "laneway_ingress_admission_in_cluster": "in_cluster",
        "laneway_ingress_admission_capacity": "capacity",
        "laneway_ingress_loop_late_seconds_sum": "late_s",
        "laneway_ingress_loop_late_seconds_count": "ticks",
        'laneway_ingress_loop_late_seconds_bucket{le="0.2"}': "ticks_under_busy",
    },
    "worker": {
        "laneway_worker_running": "running",
        "laneway_worker_queue": "waiting",
        "laneway_worker_kv_usage": "kv_usage",
        'laneway_worker_tokens_total{kind="generated"}': "generated",
        "laneway_worker_busy_seconds_total": "busy_s",
        "laneway_worker_step_seconds_count": "steps",
    },
}


def targets(state_dir: Path) -> dict[str, str]:
    """Service name → its /metrics URL, from the cluster's Prometheus targets file."""
    listed = orjson.loads((state_dir / "prometheus-targets.json").read_bytes())
    return {t["labels"]["service"]: f"http://{t['targets'][0]}/metrics" for t in listed}


def kept(service: str, text: str) -> dict[str, float]:
    """The series of ``_KEPT`` for ``service``'s kind found in an exposition ``text``."""
    kind = "worker" if "worker" in service else "ingress" if is_ingress(service) else service
    wanted = _KEPT.get(kind, {})
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


class GaugeSampler:
    """Every ``every_s`` seconds, the kept series of every ingress and worker."""

    def __init__(self, urls: dict[str, str], every_s: float = 5.0) -> None:
        self._urls = {n: u for n, u in urls.items() if is_ingress(n) or "worker" in n}
        self._every_s = every_s
        self.timeline: list[dict[str, Any]] = []

    async def run(self, t0: float) -> None:
        timeout = aiohttp.ClientTimeout(total=self._every_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                point: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
                answers = await asyncio.gather(
                    *(self._one(session, n, url) for n, url in self._urls.items())
                )
                for name, series in zip(self._urls, answers, strict=True):
                    point[name] = series
                self.timeline.append(point)
                await asyncio.sleep(self._every_s)

    async def _one(
        self, session: aiohttp.ClientSession, name: str, url: str
    ) -> dict[str, float] | str:
        try:
            async with session.get(url) as r:
                return kept(name, await r.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"unanswered: {type(exc).__name__}"


def rates(timeline: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per worker, over the sampled span: generated tokens and steps per wall second, and the
    share of wall time its engine stepped (busy seconds per second; above the modelled share when
    its own CPU, not the model, sets the pace)."""
    out: dict[str, dict[str, float]] = {}
    points = [p for p in timeline if len(p) > 1]
    if len(points) < 2:
        return out
    first, last = points[0], points[-1]
    span = last["t"] - first["t"]
    for name, end in last.items():
        start = first.get(name)
        if not ("worker" in name and isinstance(end, dict) and isinstance(start, dict)):
            continue
        delta = {k: end.get(k, 0.0) - start.get(k, 0.0) for k in ("generated", "busy_s", "steps")}
        out[name] = {
            "tokens_per_s": round(delta["generated"] / span, 1),
            "steps_per_s": round(delta["steps"] / span, 1),
            "busy_share": round(delta["busy_s"] / span, 2),
        }
    return out


def is_ingress(service: str) -> bool:
    """``laneway up`` names its one ingress ``ingress``, several ``ingress-0``, ``ingress-1``, …"""
    return service == "ingress" or service.startswith("ingress-")


def loop_late(
    timeline: list[dict[str, Any]], since: float = 0.0, ingress: str = "ingress"
) -> dict[str, float] | None:
    """An ingress's event loop from the last sample at or before ``since`` (seconds into the
    timeline) to the end: how late its clock's ticks came on average (ms) and the share that
    came more than 0.2 s late (the lateness that makes it hold its streams' writes back)."""
    points = [(p["t"], p[ingress]) for p in timeline if isinstance(p.get(ingress), dict)]
    points = [(t, p) for t, p in points if "ticks" in p]
    start = max((i for i, (t, _) in enumerate(points) if t <= since), default=0)
    if len(points) - start < 2:
        return None
    first, last = points[start][1], points[-1][1]
    ticks = last["ticks"] - first["ticks"]
    if ticks <= 0:
        return None
    busy = ticks - (last["ticks_under_busy"] - first["ticks_under_busy"])
    return {
        "mean_ms": round(1000 * (last["late_s"] - first["late_s"]) / ticks, 1),
        "busy_share": round(busy / ticks, 3),
    }
