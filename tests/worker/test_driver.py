"""The engine driver: steps while its engine has work, and says when it runs out (the worker
then sends what it held back for the next step)."""

from __future__ import annotations

import asyncio

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
