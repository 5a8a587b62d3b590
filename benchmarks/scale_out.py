"""`make bench-scale`: does throughput grow with replicas of a service, and how many requests a
second does one core of each service carry?

1. **Sizing.** `laneway up --workers 4 --speedup 1000` under a closed loop of 32 streams (8
   tokens each), nothing capped: each process's CPU over a window (/proc) and the requests
   finished in it (their terminal events on the bus), as requests a second per core of each
   service.
2. **Scaling out.** On a machine with few cores the whole cluster shares them, so adding a
   process adds no CPU. Each replica of the service under test is therefore held to a CPU quota
   of its own (``--cap`` of a core, a cgroup: root only), which makes that service the
   bottleneck; then the same load with one replica and with two (`--ingresses N`,
   `--planners N`). Throughput that doubles with the replicas (ratio near 2) is a service that
   scales out; a ratio near 1 is one whose replicas share a bottleneck.

    python -m benchmarks.scale_out [--cap 0.15 --window 10 --rounds 1]   (make bench-scale)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

import orjson

from benchmarks.bus_census import finished
from benchmarks.cpu_cap import NoCpuCap, cpu_cap
from benchmarks.live_cluster import SERVERS, add_load_arguments, closed_loop, laneway_up
from benchmarks.proc_stats import growth, snapshot

# The service under test, and the `laneway up` flag that sets its replicas.
SCALED = {"ingress": "--ingresses", "planner": "--planners"}


def service_of(process: str) -> str:
    """A process's service: ``decode-worker-2`` → ``worker``, ``ingress-1`` → ``ingress``."""
    if process.endswith("worker") or "-worker-" in process:
        return "worker"
    base, _, index = process.rpartition("-")
    return base if index.isdigit() and base else process


def measure(
    up_args: tuple[str, ...], args: argparse.Namespace, capped: str | None
) -> dict[str, Any]:
    """One `laneway up` under the load: requests a second over the window, and the cores each
    service used meanwhile. ``capped``: every process of that service held to ``args.cap``."""
    with laneway_up(args.workers, args.speedup, up_args) as up:
        load = closed_loop(
            up, args.concurrency, args.warmup + args.window + 5, args.max_tokens, "scale"
        )
        try:
            pids = {n: p for n, p in up.pids.items() if n not in SERVERS or capped is None}
            with contextlib.ExitStack() as caps:
                if capped is not None:
                    # One group a replica: each gets the quota, as each would get a host's cores.
                    for name, pid in pids.items():
                        if service_of(name) == capped:
                            caps.enter_context(cpu_cap(f"lw-{name}", args.cap, [pid]))
                time.sleep(args.warmup)
                before, start = snapshot(pids), time.monotonic()
                done = asyncio.run(finished(up.nats_url, args.window))
                grown, window_s = growth(before, snapshot(pids)), time.monotonic() - start
        finally:
            load.communicate(timeout=args.warmup + args.window + 120)
    cores: dict[str, float] = {}
    writes: dict[str, float] = {}
    for name, counters in grown.items():
        service = service_of(name)
        cores[service] = cores.get(service, 0.0) + counters["cpu_s"] / window_s
        writes[service] = writes.get(service, 0.0) + counters["syscw"] / max(done, 1)
    # Write calls a request: how much a service's loop batched (each turn flushes once).
    return {"rps": done / window_s, "cores": cores, "writes_per_request": writes}


def sizing(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Requests a second one core of each service carries, at the run's mix of load."""
    return [
        {
            "service": name,
            "cores": round(used, 3),
            "ms_per_request": round(used * 1000 / run["rps"], 3),
            "rps_per_core": round(run["rps"] / used) if used else None,
        }
        for name, used in sorted(run["cores"].items(), key=lambda kv: -kv[1])
        if name != "load-client"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scale_out",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_load_arguments(parser)
    parser.add_argument("--cap", type=float, default=0.15, help="cores each capped replica gets")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of load first")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each; medians")
    parser.add_argument("--only", choices=sorted(SCALED), action="append", help="scale this")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for round_ in range(args.rounds):
            runs.setdefault("uncapped", []).append(measure((), args, None))
            for service in args.only or sorted(SCALED):
                for replicas in (1, 2):
                    key = f"{service} x{replicas}"
                    up_args = (SCALED[service], str(replicas))
                    runs.setdefault(key, []).append(measure(up_args, args, service))
                    print(json.dumps({"round": round_ + 1, "run": key, **runs[key][-1]}))
    except NoCpuCap as err:
        print(f"bench-scale: {err}", file=sys.stderr)
        return 2
    rps = {key: statistics.median(r["rps"] for r in rs) for key, rs in runs.items()}
    print(f"\nsizing, nothing capped: {rps['uncapped']:.0f} req/s (round 1's CPU)")
    print(f"{'service':<12}{'cores':>7}{'ms/req':>9}{'req/s per core':>16}")
    table = sizing(runs["uncapped"][0])
    for row in table:
        print(f"{row['service']:<12}{row['cores']:>7.2f}{row['ms_per_request']:>9.3f}"
              f"{row['rps_per_core'] or 0:>16}")  # fmt: skip
    print(f"\nscaling out, each replica of the service held to {args.cap:g} core")
    print(f"{'service':<12}{'x1 req/s':>10}{'x2 req/s':>10}{'ratio':>7}{'cores x1':>10}{'x2':>6}")
    scaling = {}
    for service in args.only or sorted(SCALED):
        one, two = rps[f"{service} x1"], rps[f"{service} x2"]
        used = [runs[f"{service} x{n}"][0]["cores"].get(service, 0.0) for n in (1, 2)]
        scaling[service] = {"x1": one, "x2": two, "ratio": two / one, "cores": used}
        print(f"{service:<12}{one:>10.0f}{two:>10.0f}{two / one:>7.2f}"
              f"{used[0]:>10.2f}{used[1]:>6.2f}")  # fmt: skip
    summary = {"sizing": table, "scaling": scaling, "cap": args.cap, "cpus": os.cpu_count()}
    print(orjson.dumps(summary).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
