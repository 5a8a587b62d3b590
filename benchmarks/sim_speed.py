"""`make bench-sim`: how fast the offline replay runs, beside Dynamo's compiled one if it is here.

Replays the Mooncake conversation trace with the kv policy on 8 workers at speed-ups 1 and 4,
each as a `laneway bench` process, and prints each run's wall and CPU seconds and its figures.
With ``--native`` each replay runs again on the mypyc build of its hot path (`make native`, see
:mod:`infra.native`) where that build is current; its figures are the sources' to the last digit.
With a Python that has Dynamo (``--dynamo-python``; `make bench-sim` gives the reference lab's
when it is there), Dynamo's replay of the same trace runs right after each of ours: on a shared
machine only the ratio of two runs made minutes apart means anything.

    .venv/bin/python -m benchmarks.sim_speed [--rounds N] [--speedup 1 4] [--native]
        [--dynamo-python PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infra import native as native_build
from infra.bench.arguments import DEFAULT_TRACE

_ROOT = Path(__file__).resolve().parents[1]
_DYNAMO_REPLAY = _ROOT.parent / "shared/reference/dynamo/replay.py"


def _timed(command: list[str]) -> tuple[float, float, str, str]:
    """Wall and CPU seconds of ``command`` (a child process), its stdout and stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, done.stdout, done.stderr


def laneway(trace: Path, speedup: float, native: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        launch = ["-m", "infra.native", "run"] if native else ["-m"]
        command = [sys.executable, *launch, "infra.cli", "bench", "--trace", str(trace)]
        command += ["--policy", "kv", "--workers", "8", "--speedup", f"{speedup:g}"]
        command += ["--output-length", "oracle", "--json", str(out)]
        wall, cpu, _, stderr = _timed(command)
        report = json.loads(out.read_text())["kv"]
    if native and "native: compiled" not in stderr:
        raise SystemExit(f"the replay ran without its native build: {stderr.splitlines()[0]}")
    return {
        "system": "laneway",
        "native": native,
        "speedup": speedup,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "replay_s": round(report["wall_s"], 2),
        "hit": round(report["prefix_hit_rate"], 3),
        "ttft_p95_ms": round(report["ttft_ms"]["p95"], 2),
        "itl_p95_ms": round(report["itl_ms"]["p95"], 2),
        "e2e_p95_ms": round(report["e2e_ms"]["p95"], 2),
    }


def dynamo(python: Path, trace: Path, speedup: float) -> dict[str, Any]:
    command = [str(python), str(_DYNAMO_REPLAY), str(trace), "kv_router", "8", f"{speedup:g}"]
    wall, cpu, stdout, _ = _timed(command)
    summary = json.loads(stdout.strip().splitlines()[-1])
    return {
        "system": "dynamo",
        "speedup": speedup,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "replay_s": summary["wall_s"],
        "hit": round(summary["prefix_cache_reused_ratio"], 3),
        "ttft_p95_ms": round(summary["p95_ttft_ms"], 2),
        "itl_p95_ms": round(summary["p95_itl_ms"], 2),
        "e2e_p95_ms": round(summary["p95_e2e_latency_ms"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--speedup", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each")
    parser.add_argument(
        "--native", action="store_true", help="each replay also on the build of `make native`"
    )
    parser.add_argument(
        "--dynamo-python",
        type=Path,
        help="a Python with Dynamo 1.6.1 (none: Laneway alone)",
    )
    args = parser.parse_args(argv)
    if not args.trace.exists():
        print(f"no trace at {args.trace} (give one with --trace)", file=sys.stderr)
        return 2
    builds = [False]
    if args.native:
        if native_build.current(native_build.TARGET):
            builds.append(True)
        else:  # `make native` failed (no C compiler, say): the sources' figures still mean much
            print("no current native build (make native): the sources alone", file=sys.stderr)
    rows = []
    for _ in range(args.rounds):
        for speedup in args.speedup:
            for native in builds:
                rows.append(laneway(args.trace, speedup, native))
                print(json.dumps(rows[-1]), flush=True)
            if args.dynamo_python is not None:
                rows.append(dynamo(args.dynamo_python, args.trace, speedup))
                print(json.dumps(rows[-1]), flush=True)
    if args.dynamo_python is not None:
        for speedup in args.speedup:
            dynamos = [r for r in rows if (r["system"], r["speedup"]) == ("dynamo", speedup)]
            for native in builds:
                ours = [r for r in rows if r.get("native") == native and r["speedup"] == speedup]
                # CPU seconds too: on a shared machine steadier than wall, which waits for a core.
                ratio, cpu = (
                    sum(r[what] for r in ours) / sum(r[what] for r in dynamos)
                    for what in ("wall_s", "cpu_s")
                )
                print(
                    f"speed-up {speedup:g}: Laneway's {'native ' if native else ''}wall / "
                    f"Dynamo's = {ratio:.2f} (CPU {cpu:.2f})"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
