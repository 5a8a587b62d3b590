"""Per-message cost of a subscriber: Laneway's bus client (nats-py) against FastStream.

Two paths, against a nats-server started here (as the tests start one):

- token path: a core subscription receiving small ``TokensGenerated`` events, published as fast
  as it can by a separate process (so the subscriber is what limits the rate);
- intake path: a JetStream durable push consumer with explicit acks, draining ``RequestAccepted``
  events (a 2048-token prompt) already stored in a stream.

Every variant receives the same pre-encoded messages; a variant's figure is the time from its
first handled message to its last, over the messages in between (the median of ``--rounds``).
The raw nats-py callback (no decoding) is the floor both clients build on.

    .venv/bin/python -m benchmarks.bus_bench [--tokens 20000] [--requests 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType

from bus.channels import Channel, Consumer, Stream, Topic
from bus.client import Bus, at_server, event_headers
from infra.embedded import start_nats
from schemas.codec import encode
from schemas.events import (
    RequestAccepted,
    RequestSpec,
    SamplingParams,
    TokensGenerated,
    TraceContext,
    utc_now,
)

TOKEN_SUBJECT = "bench.tok.i1"
STORED_TOKEN_SUBJECT = "bench.stok.i1"
INTAKE_SUBJECT = "bench.req.accepted"
TOKENS_STREAM = Stream("BENCH_TOKENS", StorageType.MEMORY, 60.0)
INTAKE_STREAM = Stream("BENCH_INTAKE", StorageType.MEMORY, 600.0)
TOKENS: Channel[TokensGenerated] = Channel(
    "bench.tok.{ingress}", (TokensGenerated,), ("bench",), ("bench",), "core"
)
INTAKE: Channel[RequestAccepted] = Channel(
    "bench.req.accepted", (RequestAccepted,), ("bench",), ("bench",), "confirmed", INTAKE_STREAM
)
TRACE = TraceContext(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


def token_event(i: int) -> TokensGenerated:
    return TokensGenerated(
        source="worker/w1", request_id=f"r{i % 64}", worker_id="w1", index=i,
        token_ids=(101, 2023, 2003, 1037), text=" one more", trace=TRACE,
    )  # fmt: skip


def request_event(i: int) -> RequestAccepted:
    prompt = tuple(range(i, i + 2048))
    spec = RequestSpec(
        model="laneway-sim", prompt_token_ids=prompt, block_size=16,
        block_hashes=tuple(hash((i, b)) & ((1 << 63) - 1) for b in range(128)),
        sampling=SamplingParams(max_tokens=256), reply_to="i1",
        deadline=utc_now() + timedelta(hours=1),
    )  # fmt: skip
    return RequestAccepted(source="ingress/i1", request_id=f"r{i}", trace=TRACE, spec=spec)


def consumer_config() -> ConsumerConfig:
    """As the planner's intake consumer has it (bus.client.Bus.consume)."""
    return ConsumerConfig(
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_ack_pending=4096,
        deliver_policy=DeliverPolicy.ALL,
    )


@dataclass
class Counter:
    """Times the first and the last of ``expected`` handled messages."""

    expected: int
    seen: int = 0
    first: float = 0.0
    last: float = 0.0

    def __post_init__(self) -> None:
        self.done = asyncio.Event()

    def hit(self) -> None:
        now = time.perf_counter()
        self.seen += 1
        if self.seen == 1:
            self.first = now
        if self.seen == self.expected:
            self.last = now
            self.done.set()

    def us_per_msg(self) -> float:
        return (self.last - self.first) / (self.expected - 1) * 1e6


# A variant: given the server url, the subject and a counter, subscribe and return a stop.
Stop = Callable[[], Awaitable[None]]
Variant = Callable[[str, str, Counter], Awaitable[Stop]]


async def raw_core(url: str, subject: str, counter: Counter) -> Stop:
    nc = await nats.connect(url)

    async def on_msg(msg: Msg) -> None:
        counter.hit()

    await nc.subscribe(subject, cb=on_msg)
    await at_server(nc)
    return nc.close


async def bus_core(url: str, subject: str, counter: Counter) -> Stop:
    bus = await Bus.connect(url, "bench")

    async def on_tokens(event: TokensGenerated) -> None:
        counter.hit()

    await bus.subscribe(Topic(subject, TOKENS.events, (TOKENS,)), on_tokens)
    await at_server(bus.nc)
    return bus.close


async def raw_durable(url: str, subject: str, counter: Counter) -> Stop:
    nc = await nats.connect(url)

    async def on_msg(msg: Msg) -> None:
        counter.hit()
        await msg.ack()

    config = consumer_config()
    durable = f"raw-{counter.expected}-{time.monotonic_ns()}"
    await nc.jetstream().subscribe(
        subject, durable=durable, stream=INTAKE_STREAM.name, config=config, cb=on_msg,
        manual_ack=True,
    )  # fmt: skip
    return nc.close


async def bus_durable(url: str, subject: str, counter: Counter) -> Stop:
    bus = await Bus.connect(url, "bench")

    async def on_request(event: RequestAccepted) -> None:
        counter.hit()

    durable = f"bus-{counter.expected}-{time.monotonic_ns()}"
    await bus.consume(Consumer(durable, INTAKE.subject), on_request)
    return bus.close


def faststream_variant(path: Literal["core", "push", "pull"]) -> Variant | None:
    """None where FastStream is not installed (it is no dependency of Laneway)."""
    try:
        from faststream import AckPolicy as FsAckPolicy
        from faststream.nats import JStream, NatsBroker, PullSub
    except ImportError:
        return None

    async def start(url: str, subject: str, counter: Counter) -> Stop:
        async def on_tokens(event: TokensGenerated) -> None:
            counter.hit()

        async def on_request(event: RequestAccepted) -> None:
            counter.hit()

        # No logger: FastStream's default logs every message, which would dominate the figures.
        broker = NatsBroker(url, logger=None)
        if path == "core":
            broker.subscriber(subject)(on_tokens)
        else:
            durable: dict[str, Any] = dict(
                stream=JStream(INTAKE_STREAM.name, declare=False),
                durable=f"fs-{path}-{time.monotonic_ns()}",
                config=consumer_config(),
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=FsAckPolicy.NACK_ON_ERROR,
            )
            if path == "pull":
                durable["pull_sub"] = PullSub(batch_size=256)
            with warnings.catch_warnings():  # its advice to prefer pull consumers: measured
                warnings.simplefilter("ignore", RuntimeWarning)
                broker.subscriber(subject, **durable)(on_request)
        await broker.start()

        async def stop() -> None:
            await broker.stop()

        return stop

    return start


async def publish_all(url: str, subject: str, count: int) -> None:
    """The token publisher, run in its own process: as fast as nats-py goes."""
    nc = await nats.connect(url)
    messages = [(encode(e), event_headers(e)) for e in map(token_event, range(count))]
    for data, headers in messages:
        await nc.publish(subject, data, headers=headers)
    await nc.flush()
    await nc.close()


async def measure_tokens(url: str, variant: Variant, subject: str, count: int) -> float:
    counter = Counter(count)
    stop = await variant(url, subject, counter)
    publisher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bus_bench", "--publish", url, subject, str(count)
    )
    try:
        await asyncio.wait_for(counter.done.wait(), 120)
    finally:
        await publisher.wait()
        await stop()
    return counter.us_per_msg()


async def measure_intake(url: str, variant: Variant, count: int) -> float:
    counter = Counter(count)
    stop = await variant(url, INTAKE_SUBJECT, counter)
    try:
        await asyncio.wait_for(counter.done.wait(), 120)
    finally:
        await stop()
    return counter.us_per_msg()


async def store_requests(bus: Bus, count: int) -> None:
    js = bus.nc.jetstream()
    await js.add_stream(TOKENS_STREAM.config([STORED_TOKEN_SUBJECT]))
    await js.add_stream(INTAKE_STREAM.config([INTAKE_SUBJECT]))
    for event in map(request_event, range(count)):
        await bus.nc.publish(INTAKE_SUBJECT, encode(event), headers=event_headers(event))
    while (await js.stream_info(INTAKE_STREAM.name)).state.messages < count:
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class Result:
    case: str
    us_per_msg: float  # the subscriber's, first handled message to last
    server_us_per_msg: float  # nats-server's CPU time over the case, per message


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(url: str, server_pid: int, tokens: int, requests: int, rounds: int) -> list[Result]:
    """Each variant available, with its median over the rounds."""
    bus = await Bus.connect(url, "bench-setup")
    await store_requests(bus, requests)
    await bus.close()
    cases: list[tuple[str, int, Callable[[], Awaitable[float]]]] = []

    def token_case(name: str, variant: Variant | None, subject: str = TOKEN_SUBJECT) -> None:
        if variant is not None:
            case = partial(measure_tokens, url, variant, subject, tokens)
            cases.append((f"token  {name}", tokens, case))

    def intake_case(name: str, variant: Variant | None) -> None:
        if variant is not None:
            cases.append(
                (f"intake {name}", requests, partial(measure_intake, url, variant, requests))
            )

    token_case("nats-py raw callback", raw_core)
    token_case("nats-py raw, subject in a memory stream", raw_core, STORED_TOKEN_SUBJECT)
    token_case("laneway Bus.subscribe", bus_core)
    token_case("FastStream subscriber", faststream_variant("core"))
    intake_case("nats-py raw callback + ack", raw_durable)
    intake_case("laneway Bus.consume", bus_durable)
    intake_case("FastStream durable push subscriber", faststream_variant("push"))
    intake_case("FastStream durable pull subscriber", faststream_variant("pull"))
    client: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    server: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    await measure_tokens(url, raw_core, TOKEN_SUBJECT, min(tokens, 1000))  # a warm page cache
    for _ in range(rounds):  # interleaved, so a noisy moment hits every variant alike
        for name, count, case in cases:
            before = cpu_s(server_pid)
            client[name].append(await case())
            server[name].append((cpu_s(server_pid) - before) / count * 1e6)
    return [
        Result(name, statistics.median(client[name]), statistics.median(server[name]))
        for name, _, _ in cases
    ]


def report(results: list[Result]) -> str:
    laneway = {r.case.split()[0]: r.us_per_msg for r in results if "laneway" in r.case}
    header = (
        f"{'path / subscriber':46} {'µs/msg':>7} {'msgs/s':>7} {'× laneway':>9} {'server µs':>9}"
    )
    lines = [header]
    for r in results:
        ratio = r.us_per_msg / laneway[r.case.split()[0]]
        lines.append(
            f"{r.case:46} {r.us_per_msg:7.1f} {1e6 / r.us_per_msg:7.0f} {ratio:9.2f}"
            f" {r.server_us_per_msg:9.1f}"
        )
    return "\n".join(lines)


async def bench(tokens: int, requests: int, rounds: int) -> list[Result]:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats(Path(tmp))
        try:
            return await run(server.url, server.proc.pid, tokens, requests, rounds)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20000, help="token events per round")
    parser.add_argument("--requests", type=int, default=5000, help="intake events per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--publish", nargs=3, metavar=("URL", "SUBJECT", "N"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.publish:
        url, subject, count = args.publish
        asyncio.run(publish_all(url, subject, int(count)))
        return
    results = asyncio.run(bench(args.tokens, args.requests, args.rounds))
    print(report(results))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
