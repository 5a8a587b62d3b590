"""What recording every input of a decision costs the live path, per request.

Recording is ``RouteDecided`` v3 (each candidate carries all the planner knew of the worker, and
the decision its policy's turn) plus ``PlannerConfigured`` (once per planner start, so nothing
per request). The A/B is the route event as it is against the same decisions with the candidates
trimmed to the v2 fields, in one session on one cluster:

- a live cluster (sim workers, kv policy) serves short completions at concurrency 1 and 32: the
  client-side latency per request, and the cluster's CPU seconds per request;
- the decisions that run made (read back off the bus) go through the planner's and consumers'
  part of the route path twice, full and trimmed: building the candidates and the event,
  encoding it, and decoding it where it is consumed (the worker and the kv-indexer);
- both encodings are published to a JetStream stream stored as ``LW_ROUTES`` is, on the
  cluster's nats-server, alternately: the extra bytes' cost on the wire.

Recording's share of a request is (full − trimmed, route path + wire) over the request's latency
at each concurrency, and over its CPU seconds (what bounds latency once the cluster saturates).
Within a round the route path's figure is the best of six alternating turns (the least disturbed
by the other processes); each figure reported is the median of ``--rounds`` rounds.

    .venv/bin/python -m benchmarks.record_bench [--workers 8] [--requests 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from nats.js.api import StorageType
from pydantic import BaseModel, create_model

from bus.channels import Stream
from bus.client import Bus
from bus.topology import Subjects
from infra.cluster import LocalCluster
from infra.cluster_plan import ClusterConfig
from infra.ports import free_port
from schemas.codec import decode_event, encode
from schemas.events import Event, PlannerConfigured, PrefillPlacement, RouteCandidate, RouteDecided
from services.planner.replay import redecide, settings_of

# What v3 added to a candidate, and to the event.
V3_CANDIDATE_FIELDS = frozenset(
    {"in_flight", "waiting_prefill_tokens", "block_size", "kv_capacity_tokens"}
    | {"owns_session", "kv_handoff"}
)
V3_EVENT_FIELDS = frozenset({"policy_turn"})
# The worker and the kv-indexer each decode every decision.
CONSUMERS = 2
BENCH_STREAM = Stream("BENCH_RECORD", StorageType.FILE, 600.0)
CONCURRENCIES = (1, 32)


def _without(model: type[BaseModel], drop: frozenset[str], **retyped: Any) -> type[BaseModel]:
    """``model`` as it was before v3: its fields less ``drop``, some of them ``retyped``."""
    fields: dict[str, Any] = {
        name: retyped.get(name, (field.annotation, field))
        for name, field in model.model_fields.items()
        if name not in drop
    }
    return create_model(f"{model.__name__}V2", __config__=model.model_config, **fields)


CandidateV2 = _without(RouteCandidate, V3_CANDIDATE_FIELDS)
PlacementV2 = _without(
    PrefillPlacement,
    frozenset(),
    candidates=(tuple[CandidateV2, ...], ()),  # type: ignore[valid-type]
)
RouteDecidedV2 = _without(
    RouteDecided,
    V3_EVENT_FIELDS,
    schema_version=(int, 2),
    candidates=(tuple[CandidateV2, ...], ...),  # type: ignore[valid-type]
    prefill=(PlacementV2 | None, None),
)


@dataclass(frozen=True)
class Shape:
    """The models one variant of the route event is made of."""

    candidate: type[BaseModel]
    placement: type[BaseModel]
    event: type[BaseModel]
    # The fields it leaves out, of each candidate and of the event.
    drop: frozenset[str] = frozenset()
    drop_event: frozenset[str] = frozenset()


FULL = Shape(RouteCandidate, PrefillPlacement, RouteDecided)
TRIMMED = Shape(CandidateV2, PlacementV2, RouteDecidedV2, V3_CANDIDATE_FIELDS, V3_EVENT_FIELDS)


def _fields(event: RouteDecided) -> dict[str, Any]:
    """The route event's fields as plain values, as the planner has them before building it."""
    return {
        name: getattr(event, name)
        for name in RouteDecided.model_fields
        if name not in ("candidates", "prefill", "schema_version", "type")
    }


def route_path(shape: Shape, event: RouteDecided) -> Callable[[], bytes]:
    """The part of one request's route path that recording changes, in ``shape``: the
    candidates and the event built, encoded, and decoded by each consumer."""
    keep = [c.model_dump(exclude=set(shape.drop)) for c in event.candidates]
    prefill = event.prefill
    placement = prefill.model_dump(exclude={"candidates"}) if prefill is not None else None
    keep_prefill = (
        [c.model_dump(exclude=set(shape.drop)) for c in prefill.candidates] if prefill else []
    )
    fields = {k: v for k, v in _fields(event).items() if k not in shape.drop_event}

    def run() -> bytes:
        candidates = tuple(shape.candidate(**c) for c in keep)
        built = None
        if placement is not None:
            others = tuple(shape.candidate(**c) for c in keep_prefill)
            built = shape.placement(**placement, candidates=others)
        data = encode(shape.event(**fields, candidates=candidates, prefill=built))
        for _ in range(CONSUMERS):
            decode_event(data)
        return data

    return run


def _per_call_s(calls: Sequence[Callable[[], object]], repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        for call in calls:
            call()
    return (time.perf_counter() - started) / (repeat * len(calls))


@dataclass
class Round:
    latency_ms: dict[int, float]
    cpu_ms: dict[int, float]
    decide_us: float
    full_us: float
    trimmed_us: float
    full_bytes: float
    trimmed_bytes: float
    wire_full_us: float
    wire_trimmed_us: float

    @property
    def recording_us(self) -> float:
        return self.full_us - self.trimmed_us + self.wire_full_us - self.wire_trimmed_us

    def ratios(self) -> dict[str, float]:
        extra_ms = self.recording_us / 1000
        out = {}
        for c in CONCURRENCIES:
            out[f"latency_c{c}"] = extra_ms / self.latency_ms[c]
            out[f"cpu_c{c}"] = extra_ms / self.cpu_ms[c]
        return out


def in_process(events: Sequence[RouteDecided], configured: PlannerConfigured) -> dict[str, float]:
    """Full against trimmed route path per request, in turns, over the run's decisions."""
    policy, disagg = settings_of(configured)
    decide_s = _per_call_s([partial(redecide, e, policy, disagg) for e in events], 3)
    full = [route_path(FULL, e) for e in events]
    trimmed = [route_path(TRIMMED, e) for e in events]
    times: dict[str, list[float]] = {"full": [], "trimmed": []}
    for turn in range(6):  # alternate which goes first
        pair = [("full", full), ("trimmed", trimmed)]
        for name, calls in pair if turn % 2 == 0 else reversed(pair):
            times[name].append(_per_call_s(calls, 5))
    return {
        "decide_us": decide_s * 1e6,
        "full_us": min(times["full"]) * 1e6,
        "trimmed_us": min(times["trimmed"]) * 1e6,
        "full_bytes": statistics.fmean(len(f()) for f in full),
        "trimmed_bytes": statistics.fmean(len(t()) for t in trimmed),
    }


async def wire(nats_url: str, full: Sequence[bytes], trimmed: Sequence[bytes]) -> dict[str, float]:
    """A confirmed publish of each encoding to a file-stored stream, alternately, per message."""
    bus = await Bus.connect(nats_url, "record-bench")
    js = bus.nc.jetstream()
    await js.add_stream(BENCH_STREAM.config(["bench.record.>"]))
    spent = {"full": 0.0, "trimmed": 0.0}
    try:
        for _ in range(3):
            for name, batch in (("full", full), ("trimmed", trimmed)):
                for i, data in enumerate(batch):
                    started = time.perf_counter()
                    await js.publish(f"bench.record.{name}.{i % 8}", data)
                    spent[name] += time.perf_counter() - started
    finally:
        await js.delete_stream(BENCH_STREAM.name)
        await bus.close()
    return {f"wire_{k}_us": v / (3 * len(full)) * 1e6 for k, v in spent.items()}


def _cpu_s(pids: Sequence[int]) -> float:
    """User and system CPU seconds the processes have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


async def drive(
    url: str, requests: int, concurrency: int, tag: str, headers: dict[str, str]
) -> list[float]:
    """Client-side seconds per request: ``concurrency`` clients, each one request at a time."""
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient, me: int) -> None:
        for i in range(me, requests, concurrency):
            body = {"model": "laneway-sim", "prompt": f"{tag} {i:06d} " * 8, "max_tokens": 4}
            started = time.perf_counter()
            reply = await http.post(url, json=body)
            latencies.append(time.perf_counter() - started)
            reply.raise_for_status()

    # A connection per request: on a kept-alive one, httpx's headers and body go out as two
    # writes, and Nagle's algorithm against the server's delayed ACK adds ~40 ms to each request
    # after the first (measured here: 4 ms, then 45-52 ms; curl and fresh connections 3-10 ms).
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(headers=headers, timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http, me) for me in range(concurrency)))
    return latencies


class Decisions:
    def __init__(self) -> None:
        self.events: list[RouteDecided] = []
        self.configured: PlannerConfigured | None = None

    async def on_route(self, event: RouteDecided) -> None:
        self.events.append(event)

    async def on_configured(self, event: Event, _position: int) -> None:
        if isinstance(event, PlannerConfigured):
            self.configured = event


async def one_round(cluster: LocalCluster, requests: int, tag: str) -> Round:
    url = cluster.config.base_url + "/completions"
    pids = list(cluster.pids().values())
    bus = await Bus.connect(cluster.nats_url, "record-bench-observer")
    seen = Decisions()
    await bus.subscribe(Subjects.route_decisions, seen.on_route)
    await bus.replay(Subjects.planner_configured, 0, seen.on_configured)
    latency_ms, cpu_ms = {}, {}
    for c in CONCURRENCIES:
        n = max(requests, 4 * c)
        cpu = _cpu_s(pids)
        latencies = await drive(url, n, c, f"{tag}-c{c}", cluster.api_headers)
        cpu_ms[c] = (_cpu_s(pids) - cpu) / n * 1000
        latency_ms[c] = statistics.median(latencies) * 1000
    await asyncio.sleep(0.2)  # the last decisions' copies on their way to this observer
    await bus.close()
    assert seen.configured is not None, "the planner recorded no PlannerConfigured"
    cost = in_process(seen.events, seen.configured)
    full = [route_path(FULL, e)() for e in seen.events]
    trimmed = [route_path(TRIMMED, e)() for e in seen.events]
    return Round(latency_ms, cpu_ms, **cost, **await wire(cluster.nats_url, full, trimmed))


FIGURES = (
    *("decide_us", "full_us", "trimmed_us", "full_bytes", "trimmed_bytes"),
    *("wire_full_us", "wire_trimmed_us", "recording_us"),
)


def report(rounds: Sequence[Round]) -> dict[str, Any]:
    """The median over the rounds of each figure and each ratio."""
    figures = {name: statistics.median(getattr(r, name) for r in rounds) for name in FIGURES}
    for c in CONCURRENCIES:
        figures[f"latency_c{c}_ms"] = statistics.median(r.latency_ms[c] for r in rounds)
        figures[f"cpu_c{c}_ms"] = statistics.median(r.cpu_ms[c] for r in rounds)
    ratios = {k: statistics.median(r.ratios()[k] for r in rounds) for k in rounds[0].ratios()}
    return {"figures": figures, "ratios": ratios, "rounds": [asdict(r) for r in rounds]}


def _print(result: dict[str, Any]) -> None:
    f, r = result["figures"], result["ratios"]
    print(
        f"route path per request (planner build+encode, {CONSUMERS} consumers' decode): "
        f"full {f['full_us']:.1f} µs, trimmed {f['trimmed_us']:.1f} µs; "
        f"decide() {f['decide_us']:.1f} µs"
    )
    print(
        f"route event: {f['full_bytes']:.0f} B full, {f['trimmed_bytes']:.0f} B trimmed; "
        f"confirmed publish {f['wire_full_us']:.1f} µs vs {f['wire_trimmed_us']:.1f} µs"
    )
    print(f"recording per request: {f['recording_us']:.1f} µs")
    print("| concurrency | latency p50 | cluster CPU / request | recording / latency | / CPU |")
    print("| --- | --- | --- | --- | --- |")
    for c in CONCURRENCIES:
        print(
            f"| {c} | {f[f'latency_c{c}_ms']:.2f} ms | {f[f'cpu_c{c}_ms']:.2f} ms "
            f"| {r[f'latency_c{c}']:.3%} | {r[f'cpu_c{c}']:.3%} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8, help="sim workers (default: 8)")
    parser.add_argument("--requests", type=int, default=200, help="per concurrency and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; figures are medians")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="record-bench-") as state:
        cluster = LocalCluster(
            ClusterConfig(
                state_dir=Path(state),
                http_port=free_port(),
                workers=args.workers,
                # Engine steps 10 times faster than the fixed model's 5 ms: the latency is
                # mostly Laneway's own path, the harshest denominator for recording's cost.
                env={
                    "LANEWAY_PERF_MODEL": "fixed",
                    "LANEWAY_SPEEDUP": "10",
                    "LANEWAY_LOAD_REPORT_INTERVAL_S": "0.2",
                },
            )
        )
        cluster.start()
        try:
            url = cluster.config.base_url + "/completions"
            asyncio.run(drive(url, 32, 8, "warm-up", cluster.api_headers))
            rounds = []
            for i in range(args.rounds):
                rounds.append(asyncio.run(one_round(cluster, args.requests, f"round{i}")))
                shares = ", ".join(f"{k} {v:.3%}" for k, v in rounds[-1].ratios().items())
                print(f"round {i + 1}/{args.rounds}: {shares}", file=sys.stderr)
        finally:
            cluster.stop()
    result = report(rounds)
    _print(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
