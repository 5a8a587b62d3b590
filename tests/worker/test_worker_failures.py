"""A worker whose engine fails a step ends the affected requests with an error and serves on."""

from __future__ import annotations

import asyncio
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
)
from services.common.perf_model import FixedPerf
from services.common.tokenizer import ByteTokenizer
from services.engine.sim import SimConfig, SimEngine
from services.worker.runtime import Worker
from services.worker.settings import WorkerOptions
from tests.helpers import eventually


class FlakyEngine(SimEngine):
    """Fails its first step, then works."""

    failed = False

    def step(self):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().step()


def route(request_id: str, worker_id: str) -> RouteDecided:
    spec = RequestSpec(
        model="m",
        prompt_token_ids=tuple(range(40)),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=3),
        reply_to="testingress",
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
    )
    return RouteDecided(
        source="test",
        request_id=request_id,
        worker_id=worker_id,
        policy="test",
        reason="test",
        candidates=(),
        spec=spec,
    )


async def test_a_failed_step_fails_its_requests_and_the_worker_serves_on(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    engine = FlakyEngine(SimConfig(block_size=16, num_gpu_blocks=64), FixedPerf(0.0, 0.0))
    options = WorkerOptions("flaky", "both", "sim", "m", 1.0, 5, 1.0, 1.0)
    worker = Worker(bus, engine, ByteTokenizer(), options)
    etcd = connect_etcd(etcd_server.url)
    stop = asyncio.Event()
    running = asyncio.create_task(
        worker.run(LeasedKey.worker(etcd, worker.registration(), 5), stop)
    )
    ends: list[Event] = []

    async def collect(event: Event) -> None:
        ends.append(event)

    await bus.subscribe(Subjects.request_terminal("testingress"), collect)
    await asyncio.sleep(0.5)
    await bus.publish(Subjects.route("flaky"), route("first", "flaky"))
    await eventually(lambda: ends)
    await bus.publish(Subjects.route("flaky"), route("second", "flaky"))
    await eventually(lambda: len(ends) == 2)
    stop.set()
    await running
    await etcd.close()
    first, second = ends
    assert isinstance(first, RequestFailed) and first.code == "engine_error"
    assert "device lost" in first.message
    assert isinstance(second, RequestFinished) and second.usage.completion_tokens == 3
