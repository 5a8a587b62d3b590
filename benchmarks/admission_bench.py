"""Admission control under overload: 4 sim workers offered 4 times what they can serve.

Three phases against one cluster: requests one at a time (the unloaded TTFT); a closed loop of
as many clients as the cluster holds (its capacity, in completions a second); then open-loop
Poisson arrivals at ``overload`` times that rate. Admitted requests should keep their TTFT p95
within 2x the unloaded one and the rest get 429 within 100 ms, with no 5xx and no timeout.

``python -m benchmarks.admission_bench`` prints the figures as JSON (``--out`` writes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from infra.cluster import LocalCluster
from infra.cluster_plan import ClusterConfig
from infra.ports import free_port

MODEL = "laneway-sim"


@dataclass
class Outcome:
    status: int
    """HTTP status; 0: no answer (a timeout or a broken connection)."""
    seconds: float
    """To the first token (200) or to the answer (an error)."""
    complete: bool = True
    """A 200 stream ended with [DONE]."""


@dataclass
class Phase:
    name: str
    sent: int = 0
    elapsed_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, object]:
        ok = sorted(o.seconds for o in self.outcomes if o.status == 200)
        shed = sorted(o.seconds for o in self.outcomes if o.status == 429)
        return {
            "phase": self.name,
            "sent": self.sent,
            "elapsed_s": round(self.elapsed_s, 2),
            "completed": len(ok),
            "completed_per_s": round(len(ok) / self.elapsed_s, 2) if self.elapsed_s else 0.0,
            "ttft_p50_ms": _ms(_quantile(ok, 0.5)),
            "ttft_p95_ms": _ms(_quantile(ok, 0.95)),
            "shed_429": len(shed),
            "shed_p50_ms": _ms(_quantile(shed, 0.5)),
            "shed_p95_ms": _ms(_quantile(shed, 0.95)),
            "shed_max_ms": _ms(shed[-1] if shed else None),
            "errors_5xx": sum(1 for o in self.outcomes if o.status >= 500),
            "no_answer": sum(1 for o in self.outcomes if o.status == 0),
            "other_status": sum(1 for o in self.outcomes if o.status not in (0, 200, 429, 503)),
            "incomplete_streams": sum(1 for o in self.outcomes if not o.complete),
        }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class Client:
    def __init__(self, http: httpx.AsyncClient, prompt_tokens: int, max_tokens: int) -> None:
        self._http = http
        self._prompt_tokens = prompt_tokens
        self._max_tokens = max_tokens
        self._rng = random.Random(7)

    def _body(self) -> dict[str, object]:
        # A fresh prompt each time (one byte a token): no request is a cache hit of another.
        count = self._prompt_tokens // 7 + 1
        words = " ".join(f"{self._rng.randrange(10**6):06d}" for _ in range(count))
        return {
            "model": MODEL,
            "prompt": words[: self._prompt_tokens],
            "max_tokens": self._max_tokens,
            "ignore_eos": True,
            "stream": True,
        }

    async def one(self, phase: Phase) -> None:
        phase.sent += 1
        started = time.perf_counter()
        try:
            outcome = await self._send(started)
        except httpx.HTTPError:
            outcome = Outcome(0, time.perf_counter() - started, complete=False)
        phase.outcomes.append(outcome)

    async def _send(self, started: float) -> Outcome:
        async with self._http.stream("POST", "/completions", json=self._body()) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(response.status_code, time.perf_counter() - started)
            first: float | None = None
            tail = b""
            async for chunk in response.aiter_bytes():
                if first is None and b'"text":"' in chunk and b'"text":""' not in chunk:
                    first = time.perf_counter() - started
                tail = (tail + chunk)[-64:]
            done = tail.endswith(b"data: [DONE]\n\n")
            return Outcome(200, first if first is not None else 0.0, complete=done)


async def sequential(client: Client, count: int) -> Phase:
    phase = Phase("unloaded")
    started = time.perf_counter()
    for _ in range(count):
        await client.one(phase)
    phase.elapsed_s = time.perf_counter() - started
    return phase


async def closed_loop(client: Client, concurrency: int, duration_s: float) -> Phase:
    phase = Phase(f"capacity (closed loop, {concurrency} clients)")
    started = time.perf_counter()
    end = started + duration_s

    async def loop() -> None:
        while time.perf_counter() < end:
            await client.one(phase)

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    phase.elapsed_s = time.perf_counter() - started
    return phase


async def open_loop(client: Client, rate: float, duration_s: float, seed: int) -> Phase:
    phase = Phase(f"overload (Poisson, {rate:.1f}/s)")
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    started = time.perf_counter()
    at = started
    while at < started + duration_s:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(client.one(phase)))
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    phase.elapsed_s = time.perf_counter() - started
    return phase


@dataclass(frozen=True)
class BenchConfig:
    workers: int = 4
    # Small, so that 4x the cluster's capacity stays within what the client, the ingress and
    # the workers sharing a 2-core machine can push (about 50 requests a second).
    max_num_seqs: int = 2
    prompt_tokens: int = 256
    max_tokens: int = 96
    unloaded_requests: int = 30
    capacity_s: float = 8.0
    overload: float = 4.0
    overload_s: float = 15.0
    seed: int = 1


async def measure(base_url: str, config: BenchConfig, headers: dict[str, str]) -> dict[str, object]:
    capacity = config.workers * config.max_num_seqs
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=1024)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=60.0, limits=limits
    ) as http:
        client = Client(http, config.prompt_tokens, config.max_tokens)
        await sequential(client, 5)  # warm-up: connections, the planner's first decisions
        unloaded = await sequential(client, config.unloaded_requests)
        saturated = await closed_loop(client, capacity, config.capacity_s)
        rate = config.overload * len([o for o in saturated.outcomes if o.status == 200])
        rate /= saturated.elapsed_s
        overloaded = await open_loop(client, rate, config.overload_s, config.seed)
    phases = [p.summary() for p in (unloaded, saturated, overloaded)]
    base, over = phases[0]["ttft_p95_ms"], phases[2]["ttft_p95_ms"]
    ratio = over / base if isinstance(base, float) and isinstance(over, float) and base else None
    return {
        "config": asdict(config),
        "capacity_requests": capacity,
        "phases": phases,
        "overload_ttft_p95_ratio": None if ratio is None else round(ratio, 2),
    }


def run(config: BenchConfig, env: dict[str, str] | None = None) -> dict[str, object]:
    """Start a cluster of ``config.workers`` sim workers, measure, stop it."""
    with tempfile.TemporaryDirectory(prefix="laneway-admission-") as state:
        cluster = LocalCluster(
            ClusterConfig(
                state_dir=Path(state),
                http_port=free_port(),
                workers=config.workers,
                env={
                    "LANEWAY_MAX_NUM_SEQS": str(config.max_num_seqs),
                    "LANEWAY_PERF_MODEL": "dynamo-mocker",
                    **(env or {}),
                },
            )
        )
        cluster.start()
        try:
            return asyncio.run(measure(cluster.config.base_url, config, cluster.api_headers))
        finally:
            cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    config = BenchConfig(**{name: getattr(args, name) for name in asdict(defaults)})
    figures = json.dumps(run(config), indent=2)
    print(figures)
    if args.out is not None:
        args.out.write_text(figures + "\n")


if __name__ == "__main__":
    main()
