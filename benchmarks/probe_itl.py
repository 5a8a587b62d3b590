"""The live replay's inter-token latency at the client beside the workers' own (issue 14's
acceptance: the first 300 Mooncake requests at ``--time-scale 1``, the client's ITL p95 within
1.2x of the workers').

    python -m benchmarks.probe_itl [--limit 300] [--time-scale 1] [--policy kv] [--workers 8]

Runs ``laneway bench --mode live`` (a cluster of its own) and prints both sets of percentiles,
their p95 ratio and the tokens a streamed chunk carried on average (the client counts one gap
per chunk; the workers one per token).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from infra import cli


def compare(report: dict[str, Any]) -> dict[str, Any]:
    client, worker = report["itl_ms"], report["worker_itl_ms"]
    p95_ratio = client["p95"] / worker["p95"] if worker.get("p95") else None
    return {
        "client_itl_ms": {q: client[q] for q in ("p50", "p95", "p99")},
        "worker_itl_ms": {q: worker.get(q) for q in ("p50", "p95", "p99")},
        "p95_ratio": p95_ratio,
        "tokens_per_chunk": report.get("tokens_per_chunk"),
        "completed": report["completed"],
        "failed": report["failed"],
        "client_errors": report.get("client_errors"),
        "ttft_ms_p50": report["ttft_ms"]["p50"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe_itl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", type=Path, help="(default: laneway bench's, Mooncake's)")
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--policy", default="kv")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lw-probe-itl-") as tmp:
        out = Path(tmp) / "bench.json"
        code = cli.main(
            [
                "bench", "--mode", "live", "--limit", str(args.limit),
                "--time-scale", f"{args.time_scale:g}", "--policy", args.policy,
                "--workers", str(args.workers), "--json", str(out),
                *(["--trace", str(args.trace)] if args.trace else []),
            ]
        )  # fmt: skip
        if code != 0:
            return code
        report = json.loads(out.read_text())[args.policy]
    result = {"limit": args.limit, "time_scale": args.time_scale, **compare(report)}
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
