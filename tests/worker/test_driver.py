"""The engine driver: steps while its engine has work, and says when it runs out (the worker
then sends what it held back for the next step)."""

from __future__ import annotations

import asyncio

import pytest

from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest, StepResult
from services.worker.driver import EngineDriver
from tests.engine._sim_support import make_engine


async def test_the_driver_says_each_time_its_engine_runs_out_of_work() -> None:
    driver = EngineDriver(make_engine(), speedup=1000.0)
    seen: list[str] = []

    async def on_step(result: StepResult) -> None:
        seen.append("step")

    async def on_error(err: Exception) -> None:
        raise err

    async def on_idle() -> None:
        seen.append("idle")

    stepping = asyncio.create_task(driver.run(on_step, on_error, on_idle))
    try:
        for n in range(2):
            await asyncio.sleep(0.05)
            assert seen[-1:] == ["idle"]
            request = EngineRequest(f"r{n}", tuple(b"hello"), SamplingParams(max_tokens=3), ())
            driver.op(lambda r=request: driver.add(r))  # type: ignore[misc]
            before = len(seen)
            driver.wake()
            async with asyncio.timeout(5):
                while len(seen) == before or seen[-1] != "idle":
                    await asyncio.sleep(0.01)
        # Idle once before the first request, then once after each one's last step.
        assert seen[0] == "idle" and seen.count("idle") == 3
        assert seen[-2] == "step"
    finally:
        stepping.cancel()
        await asyncio.gather(stepping, return_exceptions=True)


@pytest.mark.parametrize("allowed", [True, False])
async def test_decode_steps_within_the_run_time_come_at_once_where_allowed(allowed: bool) -> None:
    driver = EngineDriver(make_engine(), 1000.0, run_s=0.5, runs_allowed=lambda: allowed)
    results: list[StepResult] = []

    async def on_step(result: StepResult) -> None:
        results.append(result)

    async def on_error(err: Exception) -> None:
        raise err

    driver.add(EngineRequest("r", tuple(b"hello"), SamplingParams(max_tokens=6), ()))
    stepping = asyncio.create_task(driver.run(on_step, on_error))
    try:
        async with asyncio.timeout(5):
            while not any(o.finished for r in results for o in r.outputs):
                await asyncio.sleep(0.01)
    finally:
        stepping.cancel()
        await asyncio.gather(stepping, return_exceptions=True)
    tokens = [t for r in results for o in r.outputs for t in o.new_token_ids]
    assert len(tokens) == 6 and driver.steps == 6
    # The prompt's step, then the five decode steps: at once (25 ms modelled, 25 µs of wall
    # time) or one by one.
    assert [len(r.step_ends_s) for r in results] == ([0, 5] if allowed else [0] * 6)
