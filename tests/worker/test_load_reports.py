"""A busy worker reports its load when it moved (a request queued, started or ended, KV
occupancy by a hundredth), not after every step: steps that only decode go out with the
periodic report."""

from __future__ import annotations

import time

from bus.client import Bus
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import RequestFinished, WorkerLoadReported
from services.common.perf_model import FixedPerf
from services.engine.protocol import EngineLoad
from services.engine.sim import SimConfig, SimEngine
from services.worker.runtime import moved
from tests.helpers import eventually
from tests.worker.harness import route, worker_publishing


def load(
    running: int = 1, waiting: int = 0, used: int = 10, loras: tuple[str, ...] = ()
) -> EngineLoad:
    return EngineLoad(running, waiting, 0, used, 1000, loras)


def test_only_what_the_cost_model_reads_moving_is_a_move() -> None:
    before = load()
    assert moved(None, before)
    assert not moved(before, load())
    assert not moved(before, load(used=19))  # under a hundredth of 1000 blocks
    assert moved(before, load(used=20))
    assert moved(before, load(used=0))
    assert moved(before, load(running=2))
    assert moved(before, load(waiting=1))
    assert moved(before, load(loras=("a",)))
    assert moved(before, EngineLoad(1, 0, 40, 10, 1000))


async def test_a_long_decode_is_reported_at_its_moves_and_periodically(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    # 10 ms a decode step, 4 steps a block of 16: 120 tokens take 1.2 s and 9 blocks.
    engine = SimEngine(SimConfig(block_size=16, num_gpu_blocks=4096), FixedPerf(0.0, 10.0))
    reports: list[tuple[float, WorkerLoadReported]] = []

    async def heard(event: WorkerLoadReported) -> None:
        reports.append((time.monotonic(), event))

    await bus.subscribe(Subjects.load("loaded").only(WorkerLoadReported), heard)
    async with worker_publishing(bus, etcd_server, engine, "loaded") as published:
        reports.clear()
        await bus.publish(Subjects.route("loaded"), route("long", "loaded", 120))
        await eventually(lambda: any(isinstance(e, RequestFinished) for e in published), timeout=10)
        ended = time.monotonic()
        await eventually(lambda: any(e.running == 0 for _, e in reports if _ >= ended - 0.2))
    # Reported when it started and when it ended; between them a report a second (the
    # harness's period), not one each 50 ms of steps (about 24).
    assert any(e.running == 1 for _, e in reports)
    assert 2 <= len(reports) <= 6, [(e.running, e.kv_blocks_used) for _, e in reports]
