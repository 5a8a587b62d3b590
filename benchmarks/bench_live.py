"""`make bench-live`: the live path's load shapes against one or more OpenAI-compatible servers,
taking turns, and a table of req/s and latency with each system's ratio to the first.

    python -m benchmarks.bench_live         # starts laneway up --workers 4 --speedup 1000
    python -m benchmarks.bench_live --target dynamo=http://127.0.0.1:8080 --laneway --rounds 3

Loads (the issue's table): ``seq`` 300 sequential requests on a new connection each, ``c32`` and
``c128`` closed loops of 32 and 128 streams for 20 s; 8 tokens, 78-character unique prompts.
A target whose processes are known (``--pids``; the laneway up started here) also shows the CPU
milliseconds a request cost it in all, its servers included: steadier than req/s on a busy box.
Targets take turns load by load (seq on each, then c32 on each, …) and ``--rounds`` repeats the
whole, so a shared machine's drift falls on every system alike; the table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from benchmarks.live_cluster import laneway_up
from benchmarks.proc_stats import growth, snapshot
from infra.bench.load_client import LoadSpec, first_model, run_load


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str
    api_key: str | None = None
    # Its processes, for the CPU a request costs it in all (none given: not measured).
    pids: tuple[int, ...] = ()


def loads(seq_requests: int, duration_s: float) -> dict[str, LoadSpec]:
    shape = LoadSpec(base_url="", model="", max_tokens=8, prompt_chars=78)
    return {
        "seq": replace(shape, requests=seq_requests, new_connection=True),
        "c32": replace(shape, concurrency=32, duration_s=duration_s),
        "c128": replace(shape, concurrency=128, duration_s=duration_s),
    }


async def run_all(
    targets: list[Target], specs: dict[str, LoadSpec], rounds: int
) -> list[dict[str, Any]]:
    models = {t.name: await first_model(t.base_url, t.api_key) for t in targets}
    results = []
    for n in range(rounds):
        for load, spec in specs.items():
            for t in targets:
                one = replace(
                    spec, base_url=t.base_url, api_key=t.api_key, model=models[t.name], label=load
                )
                before = snapshot({str(p): p for p in t.pids})
                result = await run_load(one)
                result["cpu_ms_per_request"] = _cpu_per_request(before, t.pids, result, spec)
                # How busy the shared machine was: a run is only compared with its neighbours.
                load_1m = round(os.getloadavg()[0], 2)
                result.update(system=t.name, load=load, round=n, loadavg_1m=load_1m)
                print(
                    f"  round {n} {load:<5} {t.name:<10} {result['rps']:>8.1f} req/s "
                    f"errors {result['errors']}  (load average {load_1m})",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(result)
    return results


def _cpu_per_request(
    before: dict[str, dict[str, float] | None],
    pids: tuple[int, ...],
    result: dict[str, Any],
    spec: LoadSpec,
) -> float | None:
    """The target's CPU milliseconds per request over the whole load, warm-up included."""
    grown = growth(before, snapshot({str(p): p for p in pids}))
    served = int(result["ok"]) + spec.warmup
    if not grown or not served:
        return None
    return round(1000 * sum(c["cpu_s"] for c in grown.values()) / served, 3)


_COLUMNS = (
    ("rps", "req/s"),
    ("ttft_ms_p50", "TTFT p50"),
    ("ttft_ms_p99", "TTFT p99"),
    ("lat_ms_p50", "lat p50"),
    ("lat_ms_p99", "lat p99"),
    ("itl_ms_p95", "gap p95"),
    ("cpu_ms_per_request", "CPU/req"),
    ("errors", "errors"),
)


def medians(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (load, system), each column's median over the rounds."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        grouped.setdefault((r["load"], r["system"]), []).append(r)
    out = {}
    for key, runs in grouped.items():
        row = {}
        for column, _ in _COLUMNS:
            values = [r[column] for r in runs if r.get(column) is not None]
            row[column] = statistics.median(values) if values else float("nan")
        row["rps_rounds"] = [r["rps"] for r in runs]
        out[key] = row
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    table = medians(results)
    systems = list(dict.fromkeys(r["system"] for r in results))
    head = f"{'load':<6}{'system':<10}" + "".join(f"{title:>10}" for _, title in _COLUMNS)
    lines = [head + "   (ms; medians over rounds; ratio = system / " + systems[0] + ")"]
    for load in dict.fromkeys(r["load"] for r in results):
        base = table.get((load, systems[0]))
        for system in systems:
            row = table.get((load, system))
            if row is None:
                continue
            cells = "".join(f"{row[c]:>10.2f}" for c, _ in _COLUMNS)
            lines.append(f"{load:<6}{system:<10}{cells}")
            if system != systems[0] and base is not None:
                ratio = "".join(
                    f"{row[c] / base[c]:>10.2f}" if base[c] else f"{'-':>10}"
                    for c, _ in _COLUMNS[:-1]
                )
                lines.append(f"{'':<6}{'ratio':<10}{ratio}")
    return "\n".join(lines)


def _pids(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, pids = text.partition("=")
    try:
        return name, tuple(int(p) for p in pids.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("pids are NAME=PID,PID,…") from None


def _target(text: str) -> Target:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError("a target is NAME=URL")
    return Target(name, url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target", type=_target, action="append", default=[], help="NAME=URL, repeatable"
    )
    parser.add_argument("--api-key", help="sent to every --target")
    parser.add_argument(
        "--pids",
        type=_pids,
        action="append",
        default=[],
        help="NAME=PID,PID,…: a --target's processes, for its CPU per request (repeatable)",
    )
    parser.add_argument(
        "--laneway",
        action="store_true",
        help="also start `laneway up` and add it as target 'laneway' (the default with no "
        "--target)",
    )
    parser.add_argument("--workers", type=int, default=4, help="of the laneway up started")
    parser.add_argument("--speedup", type=float, default=1000.0, help="of its sim workers")
    parser.add_argument(
        "--up-arg",
        action="append",
        default=[],
        help="passed to that laneway up, repeatable (an A/B: --up-arg=--no-auth)",
    )
    parser.add_argument("--loads", default="seq,c32,c128", help="comma-separated, of seq,c32,c128")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seq-requests", type=int, default=300)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of c32 and c128")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    args = parser.parse_args(argv)
    shapes = loads(args.seq_requests, args.duration)
    names = args.loads.split(",")
    if unknown := set(names) - set(shapes):
        parser.error(f"unknown loads: {', '.join(sorted(unknown))}")
    specs = {n: shapes[n] for n in names}
    pids = dict(args.pids)
    targets = [replace(t, api_key=args.api_key, pids=pids.get(t.name, ())) for t in args.target]
    # Stopped by a signal, the laneway up it started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        if args.laneway or not targets:
            up = stack.enter_context(laneway_up(args.workers, args.speedup, tuple(args.up_arg)))
            targets.append(Target("laneway", up.base_url, up.api_key, tuple(up.pids.values())))
        results = asyncio.run(run_all(targets, specs, args.rounds))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
