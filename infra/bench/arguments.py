"""`laneway bench`'s command line: its arguments, their defaults and their help."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from infra.arg_types import at_least, pool, positive, positive_or_zero
from infra.bench.tiers import add_tier_arguments
from infra.cluster_args import add_disagg_argument, add_perf_model_argument, add_server_arguments
from services.common.kv_transfer import KvTransferModel
from services.engine.sim import SimConfig
from services.planner.capacity import CapacitySettings
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvSettings
from services.planner.policy_registry import POLICY_NAMES

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3] / "shared/traces/mooncake_conversation_trace.jsonl"
)
_ENGINE_DEFAULTS = SimConfig()
_LINK_DEFAULTS = KvTransferModel()
_CAPACITY = CapacitySettings()
_DISAGG = DisaggSettings()


def add_sim_engine_arguments(
    parser: argparse.ArgumentParser, whose: str, num_gpu_blocks: int | None, blocks_by: str = ""
) -> None:
    """The sim engine's batch and KV sizes, for ``whose`` runs (the help's prefix); without
    a ``num_gpu_blocks`` default, ``blocks_by`` says what decides it."""
    parser.add_argument(
        "--num-gpu-blocks",
        type=at_least(1),
        default=num_gpu_blocks,
        help=f"{whose}: KV blocks per worker{f' (default: {blocks_by})' if blocks_by else ''}",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=at_least(1),
        default=_ENGINE_DEFAULTS.max_num_seqs,
        help=f"{whose}: requests in a batch",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=at_least(1),
        default=_ENGINE_DEFAULTS.max_num_batched_tokens,
        help=f"{whose}: tokens in a step",
    )


# The kv policy's knobs the bench sets from arguments of its own.
_KV_SET_BY = {
    "perf_model": "--perf-model",
    "itl_target_ms": "--itl-target-ms",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "host_link_gb_s": "--host-link-gb-s",
    "moves": "--topology",
    "lora_load_ms": "--lora-load-ms",
}


def kv_knob(text: str) -> tuple[str, float]:
    """``NAME=VALUE``: one of the kv policy's numeric knobs (``KvSettings``), as the live
    planner reads it from ``LANEWAY_KV_<NAME>``; an integer knob's value is an integer."""
    name, equals, value = text.partition("=")
    kinds = {f.name: str(f.type) for f in dataclasses.fields(KvSettings)}
    if name in _KV_SET_BY:
        raise argparse.ArgumentTypeError(f"{name} is set by {_KV_SET_BY[name]}")
    if not equals or name not in kinds:
        knobs = ", ".join(k for k in kinds if k not in _KV_SET_BY)
        raise argparse.ArgumentTypeError(f"not NAME=VALUE of a kv knob ({knobs}): {text[:60]!r}")
    if kinds[name] == "int":
        return name, at_least(0)(value)
    number = positive(value) if kinds[name] == "_Positive" else positive_or_zero(value)
    return name, number


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file")
    bench.add_argument(
        "--format",
        choices=["mooncake", "azure", "recording"],
        help="trace format (default: by extension, a `laneway record export` by its header line)",
    )
    bench.add_argument(
        "--policy", action="append", choices=list(POLICY_NAMES), help="repeatable (default: all)"
    )
    bench.add_argument("--workers", type=at_least(1), default=8, help="all workers (both roles)")
    bench.add_argument(
        "--prefill-workers",
        type=at_least(0),
        default=0,
        help="of --workers, this many prefill only",
    )
    bench.add_argument(
        "--decode-workers", type=at_least(1), help="(default: --workers minus --prefill-workers)"
    )
    add_disagg_argument(bench)
    bench.add_argument(
        "--autoscale",
        action="store_true",
        help="capacity loop on: move workers between pools (start split: --prefill-workers)",
    )
    bench.add_argument(
        "--ttft-target-ms",
        type=float,
        default=_CAPACITY.ttft_target_ms,
        help="the capacity loop's target; a remote prefill predicted past it stays local",
    )
    bench.add_argument(
        "--itl-target-ms",
        type=float,
        default=_CAPACITY.itl_target_ms,
        help="the capacity loop's target; the kv policy avoids decode steps slower than it",
    )
    bench.add_argument(
        "--plan-interval-s",
        type=float,
        default=_CAPACITY.interval_s,
        help="seconds between two looks of the capacity loop",
    )
    bench.add_argument(
        "--min-remote-tokens",
        type=int,
        default=_DISAGG.min_remote_tokens,
        help="uncached prompt tokens below which prefill stays on the decode worker",
    )
    bench.add_argument(
        "--max-handoff-ms-per-token",
        type=float,
        default=_DISAGG.max_handoff_ms_per_token,
        help="offline: a hand-off adding more to each of the request's token gaps stays local "
        "(up to --max-local-stall-tokens uncached tokens); 0: off",
    )
    bench.add_argument(
        "--max-local-stall-tokens",
        type=int,
        default=_DISAGG.max_local_stall_tokens,
        help="see --max-handoff-ms-per-token",
    )
    bench.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=_LINK_DEFAULTS.kv_bytes_per_token,
        help="KV a hand-off moves per prompt token",
    )
    bench.add_argument(
        "--link-gb-s",
        type=float,
        default=_LINK_DEFAULTS.bandwidth_gb_s,
        help="bandwidth of the prefill-to-decode link",
    )
    bench.add_argument(
        "--link-latency-ms",
        type=float,
        default=_LINK_DEFAULTS.latency_ms,
        help="latency of the prefill-to-decode link",
    )
    bench.add_argument("--speedup", type=positive, default=1.0, help="divides inter-arrival gaps")
    bench.add_argument(
        "--mode",
        choices=["offline", "live"],
        default="offline",
        help="a simulation in this process, or through the real services",
    )
    add_perf_model_argument(bench)
    add_tier_arguments(bench)
    bench.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="live: the workers' engine; vllm: vLLM running --model, sent prompts as token ids",
    )
    bench.add_argument("--model", type=Path, help="--engine vllm: a Hugging Face model folder")
    bench.add_argument(
        "--kv-cache-gib",
        type=positive,
        help="--engine vllm: each worker's KV cache, GiB (default: laneway up's, 1)",
    )
    bench.add_argument(
        "--block-size",
        type=at_least(1),
        help=f"tokens per KV block (default: sim {_ENGINE_DEFAULTS.block_size}, vllm 32)",
    )
    add_sim_engine_arguments(bench, "sim engine", _ENGINE_DEFAULTS.num_gpu_blocks)
    bench.add_argument("--limit", type=at_least(1), help="replay only the first N requests")
    bench.add_argument(
        "--sample-conversations",
        type=at_least(1),
        metavar="K",
        help="keep every K-th conversation with all its turns (before --limit): a short slice "
        "that keeps the trace's sharing between turns",
    )
    bench.add_argument(
        "--hash-id-tokens",
        type=at_least(1),
        help="tokens each block id of the trace stands for (default: the trace's, Mooncake's "
        "512; --engine vllm: the block size)",
    )
    bench.add_argument(
        "--max-prompt-tokens",
        type=at_least(1),
        help="cut prompts to this many tokens (default: all; --engine vllm: what the model's "
        "context holds beside the longest output)",
    )
    bench.add_argument(
        "--max-output-tokens", type=at_least(1), help="cut output lengths to this many tokens"
    )
    bench.add_argument(
        "--pool",
        type=pool,
        action="append",
        metavar="NAME=N",
        help="offline: N workers serving the model NAME (repeatable, instead of --workers); "
        "each request goes to its model's workers: the model its trace line names, else one "
        "dealt per conversation in proportion to the pools' workers",
    )
    tenants = "offline: the conversations dealt out to N tenants, each with its salted cache"
    bench.add_argument("--tenants", type=at_least(1), help=tenants)
    bench.add_argument(
        "--loras",
        type=at_least(1),
        help="offline: each conversation asks for one of N LoRA adapters, drawn by Zipf "
        "(--lora-zipf); a worker holds --max-loras and loads others in --lora-load-ms",
    )
    bench.add_argument("--lora-zipf", type=float, default=1.1, help="Zipf exponent of --loras")
    bench.add_argument(
        "--max-loras",
        type=at_least(1),
        default=_ENGINE_DEFAULTS.max_loras,
        help="adapters a worker holds",
    )
    bench.add_argument(
        "--lora-load-ms",
        type=float,
        default=_ENGINE_DEFAULTS.lora_load_ms,
        help="what loading an adapter a worker does not hold costs",
    )
    bench.add_argument(
        "--kv",
        type=kv_knob,
        action="append",
        metavar="NAME=VALUE",
        help="a kv policy knob, as LANEWAY_KV_<NAME> sets it live (e.g. decode_weight=0.5); "
        "repeatable",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of randomized policies")
    bench.add_argument(
        "--time-scale",
        type=positive,
        default=1.0,
        help="live, sim engine: run the whole replay this many times faster (times are scaled "
        "back; a real engine's time cannot be: --speedup compresses its arrivals)",
    )
    add_server_arguments(bench, "live: an embedded one")
    bench.add_argument("--json", type=Path, help="write the reports here")
    bench.add_argument("--plot", type=Path, help="write a PNG here")
    bench.add_argument(
        "--decisions", type=Path, help="write every routing decision and its inputs (JSONL)"
    )


def resolve_block_size(args: argparse.Namespace) -> None:
    """``--block-size``, else the engine's: the sim's default, vLLM's 32 (its CPU attention
    takes multiples of 32)."""
    if args.block_size is None:
        args.block_size = _ENGINE_DEFAULTS.block_size if args.engine == "sim" else 32
