"""`laneway bench`: the same trace through each policy, offline or live, and one report."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from infra.bench.arguments import add_bench_arguments, resolve_block_size
from infra.bench.metrics import ReplayResult
from infra.bench.offline import OfflineReplay
from infra.bench.report import format_table, write_json
from infra.bench.tiers import TierSettings, live_env, tier_settings
from infra.bench.trace_draws import with_loras, with_models, with_tenants
from infra.bench.traces import (
    TraceRequest,
    capped,
    load_trace,
    sample_conversations,
    with_block_unit,
)
from infra.engine_env import engine_env
from infra.progress import Progress
from schemas.messages import DEFAULT_MODEL
from services.common.kv_transfer import KvTransferModel
from services.engine.sim import SimConfig
from services.planner.capacity import CapacitySettings
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvSettings
from services.planner.policy_registry import POLICY_NAMES, make_policy

MODEL = DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="replay a request trace through routing policies")
    add_bench_arguments(bench)
    bench.set_defaults(func=main)


def _offline(
    trace: list[TraceRequest],
    policy: str,
    args: argparse.Namespace,
    progress: Callable[[int], None],
) -> ReplayResult:
    tiers: TierSettings = args.tiers
    config = SimConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        perf_model=args.perf_model,
        num_host_blocks=round(tiers.host_kv_ratio * args.num_gpu_blocks),
        host_link_gb_s=tiers.host_link_gb_s,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_loras=args.max_loras,
        lora_load_ms=args.lora_load_ms,
    )
    prefill, decode = _pools(args)
    disagg = DisaggSettings(
        mode=args.disagg,
        min_remote_tokens=args.min_remote_tokens,
        max_handoff_ms_per_token=args.max_handoff_ms_per_token,
        max_local_stall_tokens=args.max_local_stall_tokens,
        ttft_target_ms=args.ttft_target_ms,
        transfer=KvTransferModel(
            kv_bytes_per_token=args.kv_bytes_per_token,
            bandwidth_gb_s=args.link_gb_s,
            latency_ms=args.link_latency_ms,
        ),
    )
    autoscale = (
        CapacitySettings(
            ttft_target_ms=args.ttft_target_ms,
            itl_target_ms=args.itl_target_ms,
            interval_s=args.plan_interval_s,
        )
        if args.autoscale
        else None
    )
    kv = KvSettings(
        **dict(args.kv or ()),
        itl_target_ms=args.itl_target_ms,
        kv_bytes_per_token=args.kv_bytes_per_token,
        host_link_gb_s=tiers.host_link_gb_s,
        moves=tiers.topology is not None,
        lora_load_ms=args.lora_load_ms,
    )
    replay = OfflineReplay(
        trace,
        make_policy(policy, args.seed, kv),
        decode,
        config,
        prefill_workers=prefill,
        disagg=disagg,
        autoscale=autoscale,
        tiers=tiers,
        pools=dict(args.pool or ()) or None,
    )
    if args.decisions:
        replay.decisions = []
    replay.progress = progress
    return replay.run()


def _disagg_env(args: argparse.Namespace) -> dict[str, str]:
    """The planner's disaggregation and capacity settings, and the link the workers model."""
    return {
        "LANEWAY_DISAGG": args.disagg,
        "LANEWAY_DISAGG_MIN_REMOTE_TOKENS": str(args.min_remote_tokens),
        "LANEWAY_KV_BYTES_PER_TOKEN": str(args.kv_bytes_per_token),
        "LANEWAY_LINK_GB_S": str(args.link_gb_s),
        "LANEWAY_LINK_LATENCY_MS": str(args.link_latency_ms),
        "LANEWAY_AUTOSCALE": str(args.autoscale).lower(),
        # The loop sees wall-clock latencies of a compressed replay: scale targets and interval.
        "LANEWAY_TTFT_TARGET_MS": str(args.ttft_target_ms / args.time_scale),
        "LANEWAY_ITL_TARGET_MS": str(args.itl_target_ms / args.time_scale),
        "LANEWAY_PLAN_INTERVAL_S": str(args.plan_interval_s / args.time_scale),
    }


def _live(
    trace: list[TraceRequest],
    policy: str,
    args: argparse.Namespace,
    progress: Callable[[int], None],
) -> ReplayResult:
    # The live path's packages (NATS, aiohttp, etcd's gRPC) take a third of a second to import,
    # a tenth of an offline replay: imported only for a live one.
    import asyncio

    from infra.bench.live_replay import replay_live
    from infra.cluster import LocalCluster
    from infra.cluster_plan import ClusterConfig
    from infra.ports import free_port
    from infra.startup import StartupError

    prefill, decode = _pools(args)
    engine: dict[str, str] = args.engine_env
    with tempfile.TemporaryDirectory(prefix="laneway-bench-") as state:
        cluster = LocalCluster(
            ClusterConfig(
                state_dir=Path(state),
                http_port=free_port(),
                nats_url=args.nats_url,
                etcd_endpoints=args.etcd_endpoints,
                bus_credentials=args.bus_credentials.resolve() if args.bus_credentials else None,
                workers=decode,
                prefill_workers=prefill,
                policy=policy,
                env={
                    **_disagg_env(args),
                    **{f"LANEWAY_KV_{name.upper()}": str(value) for name, value in args.kv or ()},
                    **live_env(args.tiers, args.num_gpu_blocks),
                    "LANEWAY_PERF_MODEL": args.perf_model,
                    "LANEWAY_SPEEDUP": str(args.time_scale),
                    "LANEWAY_SEED": str(args.seed),
                    "LANEWAY_NUM_GPU_BLOCKS": str(args.num_gpu_blocks),
                    "LANEWAY_MAX_NUM_SEQS": str(args.max_num_seqs),
                    "LANEWAY_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
                    "LANEWAY_REQUEST_TIMEOUT_S": "36000",
                    # A real engine's cache and batch, as `laneway up` gives it; the block size
                    # the bench hashes its prompts at.
                    **engine,
                    "LANEWAY_BLOCK_SIZE": str(args.block_size),
                },
            )
        )
        try:
            # A vLLM worker loads its model for 15-40 s on 2 cores, the workers at once.
            cluster.start(60.0 if args.engine == "sim" else 300.0)
        except StartupError as exc:  # a port taken, a server given that does not answer
            print(f"laneway bench: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            result = asyncio.run(
                replay_live(
                    trace,
                    cluster.config.base_url,
                    cluster.nats_url,
                    engine.get("LANEWAY_MODEL", MODEL),
                    args.block_size,
                    args.time_scale,
                    progress=progress,
                    headers=cluster.api_headers,
                    token_ids=args.engine != "sim",
                )
            )
            result.report["kv_tiers"] = args.tiers.report()
            result.report["engine"] = args.engine
            return result
        finally:
            cluster.stop()


def _refused_with_engine(args: argparse.Namespace) -> str | None:
    """Why the engine flags cannot go with the others, if they cannot."""
    if args.engine == "sim":
        return "--kv-cache-gib is for --engine vllm" if args.kv_cache_gib is not None else None
    if args.mode != "live":
        return "--engine vllm is live only (an offline replay runs the sim engine)"
    if args.time_scale != 1:
        # The sim's steps take modelled time divided by the scale; vLLM's take what they take,
        # so the figures scaled back would be wrong.
        return "--time-scale is for the sim engine (vLLM runs in real time): use --speedup"
    return None


def _slice(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace's requests to replay: sampled by conversation, then the first --limit, block
    ids resized, prompts and outputs cut (a model's token ids checked); ValueError for what
    cannot be replayed."""
    sampled = args.sample_conversations is not None
    # Sampled, --limit counts the sample's requests, not the file's.
    trace = load_trace(args.trace, args.format, args.speedup, None if sampled else args.limit)
    if sampled:
        trace = sample_conversations(trace, args.sample_conversations)[: args.limit]
    unit = args.hash_id_tokens or (args.block_size if args.engine == "vllm" else None)
    if unit is not None:
        trace = with_block_unit(trace, unit)
    trace = capped(trace, None, args.max_output_tokens)
    if args.engine == "vllm":
        from infra.bench.model_prompts import check_model_vocabulary, fit_to_model

        check_model_vocabulary(args.model)
        return fit_to_model(trace, args.model, args.max_prompt_tokens)
    return capped(trace, args.max_prompt_tokens, None)


def _pools(args: argparse.Namespace) -> tuple[int, int]:
    """Prefill and decode workers."""
    if args.pool:
        return 0, sum(count for _, count in args.pool)
    prefill = args.prefill_workers
    decode = args.decode_workers if args.decode_workers is not None else args.workers - prefill
    return prefill, decode


def main(args: argparse.Namespace) -> int:
    prefill, decode = _pools(args)
    if decode < 1:
        print(
            f"laneway bench: no decode worker: {prefill} of --workers {args.workers} are "
            "prefill workers",
            file=sys.stderr,
        )
        return 2
    for offline_only in ("tenants", "loras", "pool"):
        if getattr(args, offline_only) is not None and args.mode == "live":
            print(f"laneway bench: --{offline_only} is offline only", file=sys.stderr)
            return 2
    pools = dict(args.pool or ())
    if args.pool and (len(pools) < len(args.pool) or args.prefill_workers or args.autoscale):
        print(
            "laneway bench: each --pool NAME once, and none beside --prefill-workers or "
            "--autoscale (offline, those plan one model)",
            file=sys.stderr,
        )
        return 2
    refused = _refused_with_engine(args)
    if refused:
        print(f"laneway bench: {refused}", file=sys.stderr)
        return 2
    # SystemExit, one line, for a model folder that does not fit the engine.
    args.engine_env = engine_env(args.engine, args.model, "laneway bench")
    if args.kv_cache_gib is not None:
        args.engine_env["LANEWAY_KV_CACHE_GIB"] = str(args.kv_cache_gib)
    resolve_block_size(args)
    if not args.trace.exists():
        print(f"laneway bench: no trace at {args.trace} (give one with --trace)", file=sys.stderr)
        return 2
    try:
        args.tiers = tier_settings(args, prefill + decode)
        if args.mode == "live":
            live_env(args.tiers, args.num_gpu_blocks)
        # A line of the wrong format is named with its number: one line, not a traceback.
        trace = _slice(args)
        if args.tenants is not None:
            trace = with_tenants(trace, args.tenants)
        if args.loras is not None:
            trace = with_loras(trace, args.loras, args.lora_zipf)
        if pools:
            trace = with_models(trace, pools)
    except ValueError as e:
        print(f"laneway bench: {e}", file=sys.stderr)
        return 2
    # Made now, not after minutes of replay: an output under a folder not yet made (the README's
    # /tmp/laneway/…) must not lose the run.
    for output in (args.json, args.decisions, args.plot):
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)
    policies = args.policy or list(POLICY_NAMES)
    results: dict[str, ReplayResult] = {}
    for policy in policies:
        print(f"replaying {len(trace)} requests, {args.mode}, policy {policy} …", flush=True)
        replay = _live if args.mode == "live" else _offline
        # Offline counts arrivals, live finished requests.
        with Progress(f"policy {policy}", len(trace)) as progress:
            results[policy] = replay(trace, policy, args, progress.update)
        if args.kv and policy == "kv":
            results[policy].report["kv_knobs"] = dict(args.kv)
    reports: dict[str, dict[str, Any]] = {p: r.report for p, r in results.items()}
    print(format_table(reports))
    if args.json:
        write_json(args.json, reports)
    if args.decisions:
        with args.decisions.open("w") as out:
            for policy, result in results.items():
                for decision in result.decisions:
                    out.write(orjson.dumps({"policy": policy, **decision}).decode() + "\n")
    if args.plot:
        # matplotlib takes a second to import: only when a plot is asked for.
        from infra.bench.plot import plot_reports

        title = (
            f"{args.trace.name}: {len(trace)} requests, {args.workers} workers, "
            f"speed-up {args.speedup:g}, {args.mode}, {args.perf_model}"
        )
        plot_reports(args.plot, reports, {p: r.ttft_ms() for p, r in results.items()}, title)
    return 0
