"""A worker whose engine fails a step ends the affected requests with an error and serves on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from bus.client import Bus
from bus.registry import LeasedKey, connect_etcd
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import (
    Event,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    RouteDecided,
    SamplingParams,
    TokenBatch,
)
from services.common.perf_model import FixedPerf
from services.common.tokenizer import ByteTokenizer
from services.engine.sim import SimConfig, SimEngine
from services.worker.runtime import Worker
from services.worker.settings import WorkerOptions
from tests.helpers import eventually, routed


class FlakyEngine(SimEngine):
    """Fails its step number ``fail_at`` (the first by default), then works."""

    fail_at = 1
    steps = 0

    def step(self):  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        return super().step()


def route(request_id: str, worker_id: str, max_tokens: int = 3) -> RouteDecided:
    spec = RequestSpec(
        model="m",
        prompt_token_ids=tuple(range(40)),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to="testingress",
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
    )
    return routed(request_id, worker_id, spec)


@contextlib.asynccontextmanager
async def flaky_worker(
    bus: Bus, etcd_server: EmbeddedServer, fail_at: int
) -> AsyncIterator[list[Event]]:
    """A worker named ``flaky`` whose engine fails step ``fail_at``, publishing every token
    batch and terminal to the ingress ``testingress``: the list they are collected in."""
    engine = FlakyEngine(SimConfig(block_size=16, num_gpu_blocks=64), FixedPerf(0.0, 0.0))
    engine.fail_at = fail_at
    options = WorkerOptions("flaky", "both", "sim", "m", 1.0, 5, 1.0, 1.0)
    worker = Worker(bus, engine, ByteTokenizer(), options)
    etcd = connect_etcd(etcd_server.url)
    stop = asyncio.Event()
    running = asyncio.create_task(
        worker.run(LeasedKey.worker(etcd, worker.registration(), 5), stop)
    )
    published: list[Event] = []

    async def collect(event: Event) -> None:
        published.append(event)

    await bus.subscribe(Subjects.request_terminal("testingress"), collect)
    await bus.subscribe(Subjects.tokens("testingress"), collect)
    await asyncio.sleep(0.5)
    try:
        yield published
    finally:
        stop.set()
        await running
        await etcd.close()


async def test_a_failed_step_fails_its_requests_and_the_worker_serves_on(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    async with flaky_worker(bus, etcd_server, fail_at=1) as published:

        def ends() -> list[Event]:
            return [e for e in published if not isinstance(e, TokenBatch)]

        await bus.publish(Subjects.route("flaky"), route("first", "flaky"))
        await eventually(ends)
        await bus.publish(Subjects.route("flaky"), route("second", "flaky"))
        await eventually(lambda: len(ends()) == 2)
    first, second = ends()
    assert isinstance(first, RequestFailed) and first.code == "engine_error"
    assert "device lost" in first.message
    assert isinstance(second, RequestFinished) and second.usage.completion_tokens == 3


async def test_a_failure_after_tokens_went_out_counts_them(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    """The ingress waits for every token a terminal counts before it ends the stream."""
    async with flaky_worker(bus, etcd_server, fail_at=3) as published:
        await bus.publish(Subjects.route("flaky"), route("late", "flaky", max_tokens=10))
        failed = await eventually(
            lambda: next((e for e in published if isinstance(e, RequestFailed)), None)
        )
    sent = sum(len(r.token_ids) for e in published if isinstance(e, TokenBatch) for r in e.runs)
    assert failed.code == "engine_error"
    assert failed.completion_tokens == sent > 0
