"""Many long streams at once, read by their clients, against a `laneway up` of its own: whether
the bus drops the ingress as a slow consumer, how long a new request waits for its first token
meanwhile, and how much memory nats-server takes (issue 14's acceptance: 2,000 streams of 2,000
tokens, no slow-consumer disconnect, a new request's TTFT under 1 s, NATS under 500 MB).

    python -m benchmarks.probe_streams --streams 2000 --max-tokens 2000 --duration 60

The workers are sized as a real deployment's: speed-up 1 runs Dynamo's mocker perf model (an
H100-class GPU: a decode step of 500 sequences takes 6 to 34 ms as their KV grows, so each
stream's ITL is that), 512 sequences and an H200's KV per worker. 2,000 such streams ask for
60,000 tokens a second and more: far past what four simulated workers and an ingress take on a
small machine. ``worker_rates`` says what the workers really stepped (tokens and steps a second,
the share of wall time in steps), ``gauges`` where requests waited (admission, engine queues).

Bounded: the streams open over ``--ramp`` seconds (at each 10 ms step those due by then, so a client
busy reading opens more at once rather than taking minutes), are read for ``--duration`` seconds in
all and at least ``--steady`` seconds after the last one opened, then closed (a stream not finished
by then is no error), and the cluster is stopped. From the start a short request every
``--probe-every`` seconds measures TTFT; those sent once every stream was open are the acceptance's
(``steady``). The one in flight at the end may take ``--probe-wait`` seconds more under the same
load, and one still unanswered then counts with how long it waited. Afterwards every service log is
searched for slow-consumer and reconnect lines. Over the steady window, ``steady_processes`` gives
each process's share of a core running and waiting for one, and ``ingress_loop_late`` how late the
ingress's event loop ran."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.cluster_gauges import GaugeSampler, is_ingress, loop_late, rates, targets
from benchmarks.live_cluster import RunningUp, laneway_up
from benchmarks.proc_stats import growth, rss_mb, snapshot
from infra.bench.load_client import (
    LoadSpec,
    chat_url,
    headers,
    percentile,
    prompt,
    request_body,
)

_LOG_SIGNS = re.compile(r"slow consumer|reconnect", re.IGNORECASE)


@dataclass
class StreamStats:
    opened: int = 0
    first_event: int = 0
    events: int = 0
    finished: int = 0
    # Ended by the server or the connection before [DONE], and before the probe closed it.
    cut: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    broken: Counter[str] = field(default_factory=Counter)
    error_events: Counter[str] = field(default_factory=Counter)

    def figures(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from its (kind, count) pairs as items.
        return {f.name: getattr(self, f.name) for f in fields(self)}


async def hold(
    session: aiohttp.ClientSession, url: str, hdrs: dict[str, str], body: dict[str, Any],
    stats: StreamStats,
) -> None:  # fmt: skip
    """Reads one stream to its end; counts its events without parsing them (2,000 at once)."""
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        async with session.post(url, json=body, headers=hdrs, timeout=timeout) as r:
            if r.status != 200:
                stats.refused[f"HTTP {r.status}"] += 1
                return
            stats.opened += 1
            first = True
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                if first:
                    stats.first_event += 1
                    first = False
                stats.events += 1
                if line.startswith(b"data: [DONE]"):
                    stats.finished += 1
                    return
                if line.startswith(b'data: {"error"'):
                    stats.error_events[line[6:120].decode(errors="replace")] += 1
                    return
            stats.cut += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        stats.broken[type(exc).__name__] += 1


class RssSampler:
    """Peak and timeline of processes' resident memory, read from /proc twice a second."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak_mb: dict[str, float] = dict.fromkeys(pids, 0.0)
        self.timeline: list[dict[str, float]] = []

    async def run(self, t0: float) -> None:
        tick = 0
        while True:
            now = {n: rss_mb(p) for n, p in self.pids.items()}
            for name, mb in now.items():
                if mb is not None:
                    self.peak_mb[name] = max(self.peak_mb[name], mb)
            if tick % 10 == 0:
                point = {n: round(mb, 1) for n, mb in now.items() if mb is not None}
                self.timeline.append({"t": round(time.monotonic() - t0, 1), **point})
            tick += 1
            await asyncio.sleep(0.5)


async def probe_ttft(
    base: LoadSpec, every_s: float, t0: float, stop: asyncio.Event, out: list[dict[str, Any]]
) -> None:
    """A new short request every ``every_s`` seconds until ``stop`` is set, each from a client
    process of its own: its TTFT is the cluster's, not this crowded event loop's. Cancelled, the
    one in flight is recorded with how long it had waited, unanswered."""
    n = 0
    while not stop.is_set():
        # When it was begun: starting its process can take a second on a crowded machine.
        sent_at = round(time.monotonic() - t0, 1)
        # Seeds far from the streams' (0): no probe's prompt is a stream's, cached.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infra.bench.load_client", "--base-url", base.base_url,
            "--model", base.model, "--requests", "1", "--warmup", "0", "--seed", str(10**6 + n),
            "--max-tokens", str(base.max_tokens), "--timeout", "300",
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "LANEWAY_API_KEY": base.api_key or ""},
        )  # fmt: skip
        started = time.perf_counter()
        try:
            stdout, _ = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                proc.kill()
            await proc.wait()
            waited = round((time.perf_counter() - started) * 1000, 1)
            out.append({"t": sent_at, "ttft_ms": None, "error": "unanswered", "waited_ms": waited})
            raise
        result = orjson.loads(stdout.splitlines()[-1]) if stdout.strip() else {}
        kinds = result.get("error_kinds") or {}
        error = next(iter(kinds), None) if kinds else (None if result else "probe client failed")
        out.append({"t": sent_at, "ttft_ms": result.get("ttft_ms_p50"), "error": error})
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def probe_figures(probes: list[dict[str, Any]], steady_from: float | None = None) -> dict[str, Any]:
    """Every probe counts: one unanswered when the probe ended had waited at least its
    ``waited_ms`` (its TTFT is no less), so it is in ``max`` and in ``over_1s`` if it waited
    that long. ``steady_from``: the figures of the probes sent from then on (every stream open)
    as ``steady`` besides."""
    ttfts = [p["ttft_ms"] for p in probes if p["ttft_ms"] is not None and p["error"] is None]
    unanswered = [p["waited_ms"] for p in probes if p["error"] == "unanswered"]
    bounds = ttfts + unanswered
    steady = {}
    if steady_from is not None:
        later = probe_figures([p for p in probes if p["t"] >= steady_from])
        steady = {"steady": {k: v for k, v in later.items() if k != "all"}}
    return {
        "n": len(probes),
        "answered": len(ttfts),
        "errors": sum(1 for p in probes if p["error"]),
        "unanswered": len(unanswered),
        "p50": percentile(ttfts, 50),
        "max": max(bounds) if bounds else None,
        "over_1s": sum(1 for ms in bounds if ms >= 1000),
        "error_kinds": dict(Counter(p["error"][:60] for p in probes if p["error"])),
        "all": probes,
        **steady,
    }


def steady_cpu(
    grown: dict[str, dict[str, float]], ingresses: dict[str, int], events: int, seconds: float
) -> dict[str, float | None] | None:
    """The ingresses' CPU over the steady window (``grown``: every process's counters' growth
    there): their share of a core, and per SSE event the clients read then (microseconds, and
    their write(2) calls)."""
    if not ingresses or any(name not in grown for name in ingresses):
        return None
    cpu_s = sum(grown[name]["cpu_s"] for name in ingresses)
    writes = sum(grown[name]["syscw"] for name in ingresses)
    return {
        "share": round(cpu_s / max(1e-9, seconds), 3),
        "us_per_event": round(cpu_s / events * 1e6, 1) if events else None,
        "writes_per_event": round(writes / events, 2) if events else None,
    }


def log_signs(logs: Path) -> dict[str, dict[str, Any]]:
    """Per log file: how many lines speak of slow consumers or reconnects, and the first few."""
    found: dict[str, dict[str, Any]] = {}
    # etcd's own log speaks of its gRPC reconnects at every stop: not the bus's.
    for log in sorted(p for p in logs.glob("*.log") if p.name != "etcd.log"):
        lines = log.read_text(errors="replace").splitlines()
        hits = [line for line in lines if _LOG_SIGNS.search(line)]
        if hits:
            found[log.name] = {"lines": len(hits), "first": [h[:200] for h in hits[:3]]}
    return found


async def run_probe(up: RunningUp, args: argparse.Namespace) -> dict[str, Any]:
    model = "laneway-sim"
    spec = LoadSpec(up.base_url, model, up.api_key, max_tokens=args.max_tokens, prompt_chars=78)
    probe_spec = LoadSpec(up.base_url, model, up.api_key, max_tokens=8)
    stats = StreamStats()
    probes: list[dict[str, Any]] = []
    ingresses = {n: pid for n, pid in up.pids.items() if is_ingress(n)}
    sampler = RssSampler({n: up.pids[n] for n in ("nats", *ingresses) if n in up.pids})
    gauges = GaugeSampler(targets(up.state_dir))
    url, hdrs = chat_url(up.base_url), headers(up.api_key)
    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        background = [asyncio.create_task(sampler.run(t0)), asyncio.create_task(gauges.run(t0))]
        stop = asyncio.Event()
        prober = asyncio.create_task(probe_ttft(probe_spec, args.probe_every, t0, stop, probes))
        streams: list[asyncio.Task[None]] = []
        rng = random.Random(0)
        while len(streams) < args.streams:
            # Every 10 ms, the streams due by then: a loop busy reading (each sleep long) opens
            # more at once, so the ramp keeps to its time.
            due = args.streams * (time.monotonic() - t0) / max(args.ramp, 1e-3)
            while len(streams) < min(args.streams, max(1, int(due))):
                body = request_body(spec, prompt(rng, spec.prompt_chars))
                body["ignore_eos"] = True
                streams.append(asyncio.create_task(hold(session, url, hdrs, body, stats)))
            await asyncio.sleep(0.01)
        ramp_s = time.monotonic() - t0
        processes = {**up.pids, "load-client": os.getpid()}
        events_before, steady_from = stats.events, time.monotonic()
        processes_before = snapshot(processes)
        await asyncio.sleep(max(args.steady, args.duration - ramp_s))
        in_flight = sum(1 for s in streams if not s.done())
        events_at_end = stats.events
        elapsed = time.monotonic() - t0
        grown = growth(processes_before, snapshot(processes))
        steady_s = time.monotonic() - steady_from
        ingress_cpu = steady_cpu(grown, ingresses, stats.events - events_before, steady_s)
        # No new probe; the one in flight gets its answer under the same load, for a while.
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(prober), args.probe_wait)
        for task in (prober, *background, *streams):
            task.cancel()
        for task in (prober, *background, *streams):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "workers": args.workers,
        "speedup": args.speedup,
        "ramp_s": round(ramp_s, 1),
        "elapsed_s": round(elapsed, 1),
        "in_flight_at_end": in_flight,
        # Sent, and not even a status line back by the end.
        "without_headers_at_end": args.streams
        - stats.opened
        - sum(stats.refused.values())
        - sum(stats.broken.values()),
        "stream_events_per_s": round(events_at_end / elapsed, 1),
        **stats.figures(),
        "probe_ttft_ms": probe_figures(probes, ramp_s),
        "ingress_cpu": ingress_cpu,
        "ingress_loop_late": {n: loop_late(gauges.timeline, ramp_s, n) for n in ingresses},
        # After the ramp, each process's share of a core running and waiting for one.
        "steady_processes": {
            name: {
                "cpu": round(g["cpu_s"] / steady_s, 3),
                "waiting": round(g["wait_s"] / steady_s, 3),
            }
            for name, g in sorted(grown.items())
        },
        "rss_peak_mb": {n: round(mb, 1) for n, mb in sampler.peak_mb.items()},
        "rss_timeline_mb": sampler.timeline,
        "worker_rates": rates(gauges.timeline),
        "gauges": gauges.timeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probe_streams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=2000, help="of each stream")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=1.0, help="of the sim workers")
    parser.add_argument(
        "--max-num-seqs", type=int, default=512, help="per worker: all streams run at once"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=60_000,
        help="per worker, of 16 tokens: an H200's ~125 GB of KV for Llama-3-8B (128 KiB a token)",
    )
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="the sim workers' niceness: on one machine their steps (a GPU's work in a real "
        "deployment, on hosts of their own) take CPU the serving layer would not share",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds in all, at least")
    parser.add_argument(
        "--steady", type=float, default=20.0, help="seconds at least after the last stream opened"
    )
    parser.add_argument("--ramp", type=float, default=10.0, help="seconds to open the streams")
    parser.add_argument("--probe-every", type=float, default=2.0, help="seconds between probes")
    parser.add_argument(
        "--probe-wait",
        type=float,
        default=10.0,
        help="seconds the probe in flight at the end may still take (the streams go on)",
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--state-dir", type=Path, help="the cluster's (default: a new temp dir)")
    parser.add_argument("--up-arg", action="append", default=[], help="passed to laneway up")
    args = parser.parse_args(argv)
    env = {
        "LANEWAY_MAX_NUM_SEQS": str(args.max_num_seqs),
        "LANEWAY_NUM_GPU_BLOCKS": str(args.kv_blocks),
    }
    # Kept afterwards: its logs are what shows a slow consumer.
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="lw-probe-"))
    with laneway_up(args.workers, args.speedup, tuple(args.up_arg), env, state) as up:
        workers = {name: pid for name, pid in up.pids.items() if "worker" in name}
        for pid in workers.values():
            os.setpriority(os.PRIO_PROCESS, pid, args.worker_nice)
        niceness = {name: os.getpriority(os.PRIO_PROCESS, pid) for name, pid in workers.items()}
        result = asyncio.run(run_probe(up, args))
    result["worker_niceness"] = niceness
    # Read once the cluster has stopped, its last lines in.
    result["log_signs"] = log_signs(state / "logs")
    result["state_dir"] = str(state)
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(text)
    brief = {k: v for k, v in result.items() if k not in ("rss_timeline_mb", "gauges")}
    brief["probe_ttft_ms"] = {k: v for k, v in result["probe_ttft_ms"].items() if k != "all"}
    print(orjson.dumps(brief, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
