"""What a replay measured, per request and per worker, and the report built from it."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infra.bench.busy import BusyIntervals
from services.common.token_times import TokenTimes
from services.planner.capacity import percentile_of_sorted


@dataclass(slots=True)
class RequestRecord:
    """Times in seconds from the start of the replay."""

    arrival_s: float
    prompt_tokens: int
    worker_id: str = ""
    # Where its prompt was prefilled, when not on `worker_id` (offline replays know it).
    prefill_worker_id: str = ""
    output_tokens: int = 0
    cached_tokens: int = 0
    failed: bool = False
    # When its tokens (or chunks, live) came, and the gaps between them.
    times: TokenTimes = field(default_factory=TokenTimes)

    @property
    def done(self) -> bool:
        return self.times.last_s is not None and not self.failed


@dataclass(slots=True)
class WorkerRecord:
    # (start, end) of every busy interval, in seconds from the start of the replay.
    busy: BusyIntervals = field(default_factory=BusyIntervals)
    requests: int = 0

    def busy_s(self) -> float:
        return self.busy.total_s()


@dataclass(slots=True)
class PoolUsage:
    """Seconds each pool's workers were busy, over the seconds they spent in it: a worker the
    capacity loop moved counts in each pool for the time it served there."""

    busy_s: dict[str, float] = field(default_factory=dict)
    member_s: dict[str, float] = field(default_factory=dict)

    def add(self, role: str, member_s: float, busy_s: float) -> None:
        self.member_s[role] = self.member_s.get(role, 0.0) + member_s
        self.busy_s[role] = self.busy_s.get(role, 0.0) + busy_s

    def fractions(self) -> dict[str, float]:
        return {
            role: min(1.0, self.busy_s[role] / member)
            for role, member in sorted(self.member_s.items())
            if member > 0
        }


@dataclass(slots=True)
class ReplayResult:
    report: dict[str, Any]
    records: Sequence[RequestRecord]
    # Routing decisions with their inputs, when they were collected.
    decisions: Sequence[dict[str, Any]] = ()

    def ttft_ms(self) -> list[float]:
        return _ttft_ms([r for r in self.records if r.done])


def summary(values: Sequence[float]) -> dict[str, float]:
    # Sorted once, by numpy: a replay's pooled ITL has millions of gaps. Read through a
    # memoryview (.data), which gives Python floats: no list of millions of them is made.
    ordered = np.sort(np.asarray(values, dtype=np.float64)).data
    return {
        "mean": sum(values) / len(values) if values else math.nan,
        "p50": percentile_of_sorted(ordered, 50),
        "p95": percentile_of_sorted(ordered, 95),
        "p99": percentile_of_sorted(ordered, 99),
    }


def _ttft_ms(done: Sequence[RequestRecord]) -> list[float]:
    return [((r.times.first_s or 0.0) - r.arrival_s) * 1000 for r in done]


def _e2e_ms(done: Sequence[RequestRecord]) -> list[float]:
    return [((r.times.last_s or 0.0) - r.arrival_s) * 1000 for r in done]


def by_model(
    requests: Sequence[RequestRecord], models: Sequence[str | None]
) -> dict[str, dict[str, Any]]:
    """Each model pool's requests (``models``: each request's), completed, TTFT and E2E."""
    grouped: dict[str, list[RequestRecord]] = {}
    for record, model in zip(requests, models, strict=True):
        if model is not None:
            grouped.setdefault(model, []).append(record)
    report = {}
    for model, records in sorted(grouped.items()):
        done = [r for r in records if r.done]
        report[model] = {
            "requests": len(records),
            "completed": len(done),
            "ttft_ms": summary(_ttft_ms(done)),
            "e2e_ms": summary(_e2e_ms(done)),
        }
    return report


def build_report(
    requests: Sequence[RequestRecord],
    workers: dict[str, WorkerRecord],
    wall_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    done = [r for r in requests if r.done]
    ttft, e2e = _ttft_ms(done), _e2e_ms(done)
    # Inter-token latency as vLLM's benchmark and Dynamo's replay count it: every gap between
    # consecutive tokens, pooled over requests. TPOT is the per-request view: a request's decode
    # time spread over its tokens after the first.
    itl = array("d")
    for r in done:
        itl.extend(r.times.gaps_ms)
    tpot = [
        ((r.times.last_s or 0.0) - (r.times.first_s or 0.0)) * 1000 / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1
    ]
    prompt = sum(r.prompt_tokens for r in done)
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((r.times.last_s or r.arrival_s for r in requests), default=0.0)
    span = max(end - start, 1e-9)
    busy = {w: rec.busy_s() / span for w, rec in sorted(workers.items())}
    mean_busy = sum(busy.values()) / len(busy) if busy else 0.0
    report: dict[str, Any] = {
        "requests": len(requests),
        "completed": len(done),
        "failed": len(requests) - len(done),
        "prefix_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "ttft_ms": summary(ttft),
        "itl_ms": summary(itl),
        "tpot_ms": summary(tpot),
        "e2e_ms": summary(e2e),
        "util_variance": sum((b - mean_busy) ** 2 for b in busy.values()) / len(busy)
        if busy
        else 0.0,
        "worker_busy_fraction": busy,
        "worker_requests": {w: rec.requests for w, rec in sorted(workers.items())},
        "duration_s": span,
        "wall_s": wall_s,
    }
    report.update(extra or {})
    return report


def busy_timeline(
    workers: dict[str, WorkerRecord], end_s: float, bins: int = 60
) -> dict[str, list[float]]:
    """Per worker, the busy fraction of each of ``bins`` equal windows of the replay."""
    width = max(end_s, 1e-9) / bins
    timeline = {}
    for worker_id, rec in sorted(workers.items()):
        timeline[worker_id] = rec.busy.timeline(width, bins)
    return timeline
