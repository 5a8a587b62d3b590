"""A fingerprint of an offline replay, to tell whether a change kept its results to the last digit.

Runs `laneway bench` offline in this process (its flags; one policy, kv by default) and prints one
JSON line: a SHA-256 over every request's record (all fields, every token gap's bits) and the
report (its wall time left out), the replay's CPU seconds and its headline figures. Two trees
give the same digest only if every request came out the same.

    .venv/bin/python -m benchmarks.sim_digest --speedup 4 --output-length oracle [FLAGS]
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import astuple
from typing import Any

from infra.bench import run as bench
from infra.bench.arguments import resolve_block_size
from infra.bench.metrics import ReplayResult
from infra.bench.tiers import tier_settings
from infra.bench.traces import load_trace
from infra.cli import build_parser


def digest(result: ReplayResult) -> str:
    h = hashlib.sha256()
    for record in result.records:
        *fields, (first_s, last_s, gaps, _) = astuple(record)
        h.update(repr([*fields, first_s, last_s]).encode())
        h.update(gaps.tobytes())
    report = {k: v for k, v in result.report.items() if k != "wall_s"}
    h.update(json.dumps(report, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    args = build_parser("bench").parse_args(["bench", *argv])
    resolve_block_size(args)
    args.tiers = tier_settings(args, sum(bench._pools(args)))
    if not args.trace.exists():
        print(f"no trace at {args.trace} (give one with --trace)", file=sys.stderr)
        return 2
    trace = load_trace(args.trace, args.format, args.speedup, args.limit)
    policy = (args.policy or ["kv"])[0]
    started = time.process_time()
    result = bench._offline(trace, policy, args, lambda arrived: None)
    cpu = time.process_time() - started
    report: dict[str, Any] = result.report
    line = {
        "digest": digest(result)[:16],
        "replay_cpu_s": round(cpu, 2),
        "hit": round(report["prefix_hit_rate"], 3),
        "ttft_p95_ms": round(report["ttft_ms"]["p95"], 2),
        "itl_p95_ms": round(report["itl_ms"]["p95"], 2),
        "e2e_p95_ms": round(report["e2e_ms"]["p95"], 2),
        "kv_moves": report["kv_moves"],
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
