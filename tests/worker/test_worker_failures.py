"""A worker whose engine fails a step ends the affected requests with an error and serves on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from bus.client import Bus
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import (
    Event,
    RequestFailed,
    RequestFinished,
    TokenBatch,
)
from services.common.perf_model import FixedPerf
from services.engine.sim import SimConfig, SimEngine
from tests.helpers import eventually
from tests.worker.harness import route, worker_publishing


class FlakyEngine(SimEngine):
    """Fails its step number ``fail_at`` (the first by default), then works; a decode run that
    would take that step fails whole."""

    fail_at = 1
    steps = 0

    def step(self):  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device lost")
        return super().step()

    def run_steps(self, until_s):  # type: ignore[no-untyped-def]
        run = super().run_steps(until_s)
        if run is not None:
            first, self.steps = self.steps + 1, self.steps + len(run.step_ends_s)
            if first <= self.fail_at <= self.steps:
                raise RuntimeError("device lost")
        return run


@contextlib.asynccontextmanager
async def flaky_worker(
    bus: Bus, etcd_server: EmbeddedServer, fail_at: int
) -> AsyncIterator[list[Event]]:
    """A worker named ``flaky`` whose engine fails step ``fail_at`` (see worker_publishing)."""
    engine = FlakyEngine(SimConfig(block_size=16, num_gpu_blocks=64), FixedPerf(0.0, 0.0))
    engine.fail_at = fail_at
    async with worker_publishing(bus, etcd_server, engine, "flaky") as published:
        yield published


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
