"""`make profile`: where a live request's CPU goes, service by service.

Starts `laneway up --workers 4 --speedup 1000` and a closed loop of 32 streams against it (the
load client in a process of its own), then, after a warm-up:

1. a quiet window: every process's CPU seconds from /proc (the services, nats-server, etcd and
   the client), as a share of a core and as CPU milliseconds per request, the share of the window
   it waited for a CPU (/proc/PID/task/*/schedstat: ready, but every core taken), its read and write
   system calls per request (/proc/PID/io counts read(2)/write(2): uvloop's and nats-server's
   socket I/O; the standard loop's recv/send, as the client's, show as none). Requests: those
   whose terminal event came in the window;
2. NATS messages per request by kind of subject, counted by a subscriber to every subject
   (benchmarks/bus_census.py);
3. a sampled window: py-spy records each Python service (``--nonblocking``: the service is never
   paused), written as collapsed stacks (``<service>.txt``: flamegraph.pl or speedscope.app draw
   them) and summed by package and function (``<service>.top.txt``).

    python -m benchmarks.profile_live --out /tmp/laneway-profile
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.bus_census import census, finished, per_request
from benchmarks.live_cluster import SERVERS, add_load_arguments, closed_loop, laneway_up
from benchmarks.proc_stats import COUNTERS, growth, snapshot
from benchmarks.profile_summary import parse, report


def spy(
    pids: dict[str, int], out: Path, seconds: float, rate: int, native: bool
) -> dict[str, Path]:
    """Records each process with py-spy at once; its collapsed stacks, by name. ``native``
    adds C frames, which py-spy reads only by pausing the process at each sample."""
    binary = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if binary is None:
        raise SystemExit("profile: py-spy not found (pip install -e '.[dev]')")
    runs = {}
    for name, pid in pids.items():
        path = out / f"{name}.txt"
        command = [
            binary, "record", "--pid", str(pid), "--duration", f"{seconds:g}",
            "--rate", str(rate), "--native" if native else "--nonblocking",
            "--format", "raw", "--output", str(path),
        ]  # fmt: skip
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        runs[name] = (proc, path)
    written = {}
    for name, (proc, path) in runs.items():
        _, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode == 0 and path.exists():
            written[name] = path
        else:
            print(f"profile: py-spy on {name} failed: {err.decode()[-300:]}", file=sys.stderr)
    return written


def cpu_table(
    grown: dict[str, dict[str, float]], window_s: float, requests: float
) -> list[dict[str, Any]]:
    def row(name: str, c: dict[str, float]) -> dict[str, Any]:
        per = (lambda v: round(v / requests, 3)) if requests else (lambda v: None)
        return {
            "process": name,
            "cpu_s": round(c["cpu_s"], 3),
            "core_share": round(c["cpu_s"] / window_s, 3),
            # Ready to run, no CPU free: above core_share, the process waited more than it ran.
            "wait_share": round(c["wait_s"] / window_s, 3),
            "cpu_ms_per_request": per(1000 * c["cpu_s"]),
            "reads_per_request": per(c["syscr"]),
            "writes_per_request": per(c["syscw"]),
        }

    rows = [row(n, c) for n, c in sorted(grown.items(), key=lambda kv: -kv[1]["cpu_s"])]
    total = {k: sum(c[k] for c in grown.values()) for k in COUNTERS}
    return [*rows, row("all", total)]


def print_table(table: list[dict[str, Any]]) -> None:
    head = ("ms/req", "reads/req", "writes/req")
    print(
        f"{'process':<18}{'cpu s':>8}{'cores':>7}{'waiting':>9}" + "".join(f"{h:>11}" for h in head)
    )
    for r in table:
        per = [r[k] for k in ("cpu_ms_per_request", "reads_per_request", "writes_per_request")]
        cells = "".join(f"{v:>11.3f}" if v is not None else f"{'-':>11}" for v in per)
        share = f"{r['cpu_s']:>8.2f}{r['core_share']:>7.2f}{r['wait_share']:>9.2f}"
        print(f"{r['process']:<18}{share}{cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/laneway-profile"))
    add_load_arguments(parser)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load first")
    parser.add_argument("--cpu-window", type=float, default=10.0, help="seconds, /proc only")
    parser.add_argument(
        "--census-window", type=float, default=5.0, help="seconds counting bus messages"
    )
    parser.add_argument("--spy-window", type=float, default=15.0, help="seconds under py-spy")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples a second")
    parser.add_argument(
        "--native",
        action="store_true",
        help="C frames too (uvloop, the codecs); py-spy then pauses each service per sample",
    )
    parser.add_argument("--only", action="append", help="py-spy only this service, repeatable")
    parser.add_argument("--up-arg", action="append", default=[], help="passed to laneway up")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    load_s = args.warmup + args.cpu_window + args.census_window + args.spy_window + 2
    with laneway_up(args.workers, args.speedup, tuple(args.up_arg)) as up:
        load = closed_loop(up, args.concurrency, load_s, args.max_tokens, "profile")
        time.sleep(args.warmup)
        pids = {**up.pids, "load-client": load.pid}
        before, start = snapshot(pids), time.monotonic()
        done = asyncio.run(finished(up.nats_url, args.cpu_window))
        grown, window_s = growth(before, snapshot(pids)), time.monotonic() - start
        kinds, census_done = asyncio.run(census(up.nats_url, args.census_window))
        services = {
            n: p
            for n, p in up.pids.items()
            if n not in SERVERS and (args.only is None or n in args.only)
        }
        stacks = spy(services, args.out, args.spy_window, args.rate, args.native)
        out, _ = load.communicate(timeout=load_s + 120)
    result = orjson.loads(out.splitlines()[-1])
    table = cpu_table(grown, window_s, done)
    messages = per_request(kinds, census_done)
    summary = {
        "load": result,
        "cpu_window_s": round(window_s, 3),
        "cpu_window_requests": done,
        "cpu": table,
        "bus_messages": messages,
    }
    (args.out / "cpu.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    tops = {}
    for name, path in stacks.items():
        with path.open() as lines:
            tops[name] = report(name, parse(lines))
        (args.out / f"{name}.top.txt").write_text(tops[name])
    print(f"c={args.concurrency}: {result['rps']} req/s, errors {result['errors']}")
    print_table(table)
    print(f"\n{'NATS subject':<34}{'msgs/req':>9}{'bytes/msg':>10}")
    for m in messages:
        size = m.get("bytes_per_message", "")
        print(f"{m['subject']:<34}{m['messages_per_request']:>9.2f}{size:>10}")
    for text in tops.values():
        print("\n" + "\n".join(text.splitlines()[:12]))
    print(f"\nstacks and summaries in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
