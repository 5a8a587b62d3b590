"""What if another policy had routed the recorded arrivals: the log's requests replayed through
the offline simulator under it, beside the figures the live run measured.

Both sides count alike, as `laneway bench` does: TTFT and E2E from the request's arrival (its
``RequestAccepted``) to its first and last token, ITL over every gap between consecutive tokens
(the workers' histograms), the hit rate over the prompt tokens of completed requests.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra import cluster_args
from infra.arg_types import at_least
from infra.bench.arguments import add_sim_engine_arguments
from infra.debug.log import LogIndex, RequestLog
from infra.progress import Progress
from infra.recording import RecordingError
from schemas.events import RequestFinished
from schemas.latency import LatencyHistogram
from services.engine.sim import SimConfig
from services.planner.policy_registry import POLICY_NAMES
from services.planner.replay import settings_of

# The simulator and its report (numpy: the `bench` extra) are imported where a what-if runs, so
# that `laneway replay` without one needs neither.
if TYPE_CHECKING:
    from infra.bench.metrics import ReplayResult

# What the comparison reads of the log (as they appear in a recording's lines).
EVENTS = ('"RequestAccepted"', '"RouteDecided"', '"RequestFinished"', '"RequestFailed"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="what if this policy had routed the recorded arrivals (the offline simulator)",
    )
    parser.add_argument(
        "--workers", type=at_least(1), help="what-if: decode workers (default: as many as recorded)"
    )
    parser.add_argument(
        "--prefill-workers",
        type=at_least(0),
        help="what-if: prefill workers (default: as recorded)",
    )
    parser.add_argument(
        "--disagg",
        choices=["never", "always", "auto"],
        help="what-if: remote prefill never, always or when it pays (default: as recorded)",
    )
    parser.add_argument("--seed", type=int, help="what-if: policy seed (default: as recorded)")
    cluster_args.add_perf_model_argument(parser)
    add_sim_engine_arguments(parser, "what-if", None, "the recorded workers' KV capacity")
    parser.add_argument("--plot", type=Path, help="what-if: write a PNG comparing both here")


@dataclass(frozen=True)
class WhatIf:
    # {"settings", "recorded", "what_if"}: the settings simulated, and a report for each side.
    report: dict[str, dict[str, Any]]
    recorded_ttft_ms: list[float]
    simulated: ReplayResult


def what_if(log: LogIndex, args: argparse.Namespace) -> WhatIf:
    from infra.bench.offline import OfflineReplay
    from infra.bench.traces import recording_trace

    routed = log.routed()
    if not routed:
        raise RecordingError("no routing decision in this log: nothing to compare")
    first = routed[0].route
    assert first is not None
    config = log.config_of(first)
    if config is None:
        raise RecordingError(f"no PlannerConfigured for {first.source}: its settings are unknown")
    # Both sides in the perf model's time: a run whose sim workers were sped up
    # (`laneway bench --time-scale`) has its arrivals and latencies scaled back, as the live
    # bench reports them.
    scale = config.speedup
    recorded, recorded_ttft = recorded_report(list(log.requests.values()), scale)
    trace = recording_trace(log.recorded, speedup=1 / scale)
    decoders, prefillers = _pools(routed)
    block_size = first.spec.block_size
    capacity = max(c.kv_capacity_tokens for c in first.candidates)
    settings: dict[str, Any] = {
        "recorded_policy": first.policy,
        "policy": args.policy,
        "workers": decoders if args.workers is None else args.workers,
        "prefill_workers": _prefill_pool(args, prefillers),
        "seed": config.seed if args.seed is None else args.seed,
        "block_size": block_size,
        "num_gpu_blocks": args.num_gpu_blocks or max(1, capacity // block_size),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "perf_model": args.perf_model,
        "time_scale": scale,
    }
    policy, disagg = settings_of(
        config.model_copy(update={"policy": args.policy, "seed": settings["seed"]})
    )
    disagg = dataclasses.replace(disagg, mode=args.disagg or disagg.mode)
    settings["disagg"] = disagg.mode
    try:
        sim = SimConfig(
            block_size=block_size,
            num_gpu_blocks=settings["num_gpu_blocks"],
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            perf_model=args.perf_model,
        )
        replay = OfflineReplay(
            trace,
            policy,
            settings["workers"],
            sim,
            prefill_workers=settings["prefill_workers"],
            disagg=disagg,
        )
    except ValueError as err:
        raise RecordingError(f"cannot simulate these settings: {err}") from None
    with Progress(f"what-if {args.policy}", len(trace)) as progress:
        replay.progress = progress.update
        result = replay.run()
    report = {"settings": settings, "recorded": recorded, "what_if": result.report}
    return WhatIf(report, recorded_ttft, result)


def _prefill_pool(args: argparse.Namespace, recorded: int) -> int:
    if args.prefill_workers is not None:
        return int(args.prefill_workers)
    # Only the kv policy's cost model places prefills: under another, the pool would idle.
    return recorded if args.policy == "kv" else 0


def _pools(routed: list[RequestLog]) -> tuple[int, int]:
    """The decode and prefill pool sizes most decisions saw (a death or a role move changes
    them for a while)."""
    sizes: Counter[tuple[int, int]] = Counter()
    for log in routed:
        route = log.route
        assert route is not None
        prefill = route.prefill.candidates if route.prefill is not None else ()
        sizes[len(route.candidates), len(prefill)] += 1
    return sizes.most_common(1)[0][0]


def recorded_report(
    logs: list[RequestLog], scale: float = 1.0
) -> tuple[dict[str, Any], list[float]]:
    """The live run's figures, shaped like one policy of `laneway bench --json`, and its TTFTs;
    every time multiplied by ``scale``."""
    from infra.bench.metrics import summary

    ttft: list[float] = []
    e2e: list[float] = []
    tpot: list[float] = []
    gaps = LatencyHistogram()
    prompt = cached = 0
    served: Counter[str] = Counter()
    times: list[datetime] = []
    requests = 0
    for log in logs:
        if log.accepted is None:
            continue
        requests += 1
        arrived = log.accepted.occurred_at
        times.append(arrived)
        end = log.terminal
        if not isinstance(end, RequestFinished):
            continue
        times.append(end.occurred_at)
        # The worker times first and last token from when it received the route.
        after_route = (end.occurred_at - arrived).total_seconds() * 1000 - end.e2e_ms
        ttft.append(scale * (max(0.0, after_route) + end.ttft_ms))
        e2e.append(scale * (max(0.0, after_route) + end.e2e_ms))
        if end.usage.completion_tokens > 1:
            tpot.append(scale * (end.e2e_ms - end.ttft_ms) / (end.usage.completion_tokens - 1))
        gaps.merge(end.token_gaps)
        prompt += end.usage.prompt_tokens
        cached += end.usage.cached_tokens
        served[end.worker_id] += 1
    # A histogram has percentiles, not the mean.
    itl: dict[str, float | None] = {"mean": None}
    itl |= {f"p{q}": _times(gaps.percentile(q), scale) for q in (50, 95, 99)}
    report = {
        "requests": requests,
        "completed": len(ttft),
        "failed": requests - len(ttft),
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": summary(ttft),
        "itl_ms": itl,
        "tpot_ms": summary(tpot),
        "e2e_ms": summary(e2e),
        "worker_requests": dict(sorted(served.items())),
        "duration_s": scale * (max(times) - min(times)).total_seconds() if times else 0.0,
    }
    return report, ttft


def _times(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
