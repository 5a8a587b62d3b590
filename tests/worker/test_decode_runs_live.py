"""A worker whose engine steps faster than its token interval does its decode steps many at
once, and still ends an answer at the step that completed a stop string."""

from __future__ import annotations

from bus.client import Bus
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import RequestFinished, TokenBatch
from services.common.perf_model import FixedPerf
from services.engine.sim import SimConfig, SimEngine
from tests.helpers import eventually
from tests.worker.harness import route, worker_publishing


async def test_a_stop_string_ends_the_answer_at_its_step_though_steps_run_at_once(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    # Steps of no modelled time: every decode step a run may take, it takes.
    engine = SimEngine(SimConfig(block_size=16, num_gpu_blocks=64), FixedPerf(0.0, 0.0))
    async with worker_publishing(bus, etcd_server, engine, "runs") as published:

        async def answer(request_id: str, stop: tuple[str, ...]) -> tuple[str, RequestFinished]:
            await bus.publish(Subjects.route("runs"), route(request_id, "runs", 40, stop))
            end = await eventually(
                lambda: next(
                    (e for e in published if isinstance(e, RequestFinished)
                     and e.request_id == request_id),
                    None,
                )
            )  # fmt: skip
            text = "".join(
                r.text
                for e in published
                if isinstance(e, TokenBatch)
                for r in e.runs
                if r.request_id == request_id
            )
            return text, end

        free, whole = await answer("free", ())
        # The free answer came in fewer batches than tokens: its decode steps went at once.
        batches = [e for e in published if isinstance(e, TokenBatch)]
        assert whole.usage.completion_tokens == 40 and len(batches) < 40
        stop = free[20:22]
        stopped, end = await answer("stopped", (stop,))
    first = free.find(stop)
    assert stopped == free[:first] and end.finish_reason == "stop"
    assert end.usage.completion_tokens == len((free[:first] + stop).encode())
