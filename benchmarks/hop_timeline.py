"""`make hops`: where a sequential request's time goes, message by message on the bus.

`make profile` says where a request's CPU goes; this says when each hop happens. It starts
`laneway up --workers 4 --speedup 1000` (or drives a running cluster: ``--base-url`` and
``--nats-url``, the latter with the admin's credentials), listens to every subject as the
cluster's admin, and sends ``--requests`` requests one at a time, each on a new connection and
``--gap-ms`` after the last ended, so that each request's messages are alone on the bus. For
every message a request causes, in the order they come, it prints the median time after the
client sent the request: the kind of subject (ids masked, as `make profile`'s census groups
them) and its number within the request (``lw.tok.*.*#3``: the request's third token batch; a
message a JetStream consumer is delivered shows twice, published then delivered), beside the
client's first text and its end.

    python -m benchmarks.hop_timeline --requests 60

The listener is a process of its own on the same clock (``time.perf_counter``, the system's
monotonic clock): a message's time is when its callback ran there. Being sent every message
costs the server and the machine, so requests take longer here than under `load_client` alone;
the order and the gaps are what to read. A message some requests cause and others not (a load
report) is shown with how many did.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
import nats
import orjson

from benchmarks.bus_census import subject_kind
from benchmarks.live_cluster import laneway_up
from bus.client import at_server
from infra.bench.load_client import (
    LoadSpec,
    Sample,
    chat_url,
    first_model,
    headers,
    prompt,
    request_body,
    stream_one,
)

# A seen message: when (``time.perf_counter``) and its kind of subject.
Seen = tuple[float, str]
CLIENT_FIRST = "client: first text"
CLIENT_END = "client: end"


@dataclass(frozen=True)
class Row:
    label: str
    median_ms: float
    """After the client sent the request."""
    requests: int
    """Of the requests, how many had this message."""


def timeline(seen: Sequence[Seen], samples: Sequence[Sample]) -> list[Row]:
    """Each request's messages (those between its sending and the next request's), labelled by
    kind and number within the request; the median time of each label after its request was
    sent, in the order of those medians. Requests that failed are left out."""
    offsets: dict[str, list[float]] = {}
    ordered = sorted(seen)
    times = [at for at, _ in ordered]
    ok = [s for s in samples if s.error is None and s.first is not None]
    for i, sample in enumerate(ok):
        until = ok[i + 1].sent if i + 1 < len(ok) else float("inf")
        counts: Counter[str] = Counter()
        for at, kind in ordered[bisect_left(times, sample.sent) : bisect_left(times, until)]:
            counts[kind] += 1
            offsets.setdefault(f"{kind}#{counts[kind]}", []).append(at - sample.sent)
        assert sample.first is not None
        offsets.setdefault(CLIENT_FIRST, []).append(sample.first - sample.sent)
        offsets.setdefault(CLIENT_END, []).append(sample.end - sample.sent)
    rows = [
        Row(label, statistics.median(values) * 1000, len(values))
        for label, values in offsets.items()
    ]
    return sorted(rows, key=lambda row: (row.median_ms, row.label))


def _listen(nats_url: str, out: Connection) -> None:
    """The listener's process: every message's time and kind until told to stop, then all of
    them back through ``out``."""
    seen: list[Seen] = []

    async def listen() -> None:
        async def on_msg(msg: Any) -> None:
            seen.append((time.perf_counter(), subject_kind(msg.subject)))

        connection = await nats.connect(nats_url, name="laneway-bench-hops")
        await connection.subscribe(">", cb=on_msg, pending_msgs_limit=1_000_000)
        await at_server(connection)
        out.send("ready")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, out.recv)
        await connection.close()

    asyncio.run(listen())
    out.send(seen)


async def send_one_by_one(
    base_url: str, api_key: str | None, model: str, requests: int, gap_s: float
) -> list[Sample]:
    spec = LoadSpec(base_url, model, api_key, new_connection=True)
    rng = random.Random(spec.seed)
    samples: list[Sample] = []
    url, auth = chat_url(base_url), headers(api_key)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(requests):
            body = request_body(spec, prompt(rng, spec.prompt_chars))
            samples.append(await stream_one(session, url, body, auth, spec.timeout_s))
            await asyncio.sleep(gap_s)
    return samples


def follow(
    base_url: str, nats_url: str, api_key: str | None, requests: int, gap_s: float, warmup: int
) -> tuple[list[Seen], list[Sample]]:
    """The bus's messages and the requests' samples, after ``warmup`` requests not counted."""
    model = asyncio.run(first_model(base_url, api_key))
    asyncio.run(send_one_by_one(base_url, api_key, model, warmup, gap_s))
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    listener = spawn.Process(target=_listen, args=(nats_url, there), daemon=True)
    listener.start()
    try:
        if not here.poll(30) or here.recv() != "ready":
            raise RuntimeError("the bus listener did not start")
        samples = asyncio.run(send_one_by_one(base_url, api_key, model, requests, gap_s))
        here.send("stop")
        if not here.poll(30):
            raise RuntimeError("the bus listener did not hand over what it heard")
        seen: list[Seen] = here.recv()
    finally:
        listener.join(timeout=10)
        if listener.is_alive():
            listener.kill()
    return seen, samples


def render(rows: Sequence[Row], requests: int) -> str:
    lines = [f"{'ms after send':>14}  {'seen':>9}  message"]
    for row in rows:
        lines.append(f"{row.median_ms:14.2f}  {row.requests:>4}/{requests:<4}  {row.label}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hop_timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="requests sent first, not counted")
    parser.add_argument(
        "--gap-ms", type=float, default=50.0, help="pause after each request: its last messages"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--base-url", help="a running cluster's API instead of a laneway up")
    parser.add_argument("--nats-url", help="with --base-url: its NATS, as the admin")
    parser.add_argument("--api-key")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if bool(args.base_url) != bool(args.nats_url):
        parser.error("--base-url and --nats-url go together")

    def measure(base_url: str, nats_url: str, api_key: str | None) -> list[Row]:
        gap_s = args.gap_ms / 1000
        return timeline(*follow(base_url, nats_url, api_key, args.requests, gap_s, args.warmup))

    if args.base_url:
        rows = measure(args.base_url, args.nats_url, args.api_key)
    else:
        with laneway_up(args.workers, args.speedup) as up:
            rows = measure(up.base_url, up.nats_url, up.api_key)
    if args.json:
        print(orjson.dumps([row.__dict__ for row in rows]).decode())
    else:
        print(render(rows, args.requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
