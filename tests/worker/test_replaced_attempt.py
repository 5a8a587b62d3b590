"""A request that moved away from a worker and back: the new attempt replaces the old one there
(same request id in the engine), and no output of a step that ran the old one may go into the new
attempt's answer (a step's outputs are handed over after its duration is waited out, and the
route of the new attempt may come meanwhile)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from bus.blobs import BlobAssembler
from bus.client import Bus
from schemas.events import (
    RequestFinished,
    RequestSpec,
    SamplingParams,
    TokenBatch,
    TokenRun,
)
from services.common.tokenizer import ByteTokenizer
from services.engine.protocol import EngineCapabilities, EngineRequest, StepResult
from services.worker.driver import EngineDriver
from services.worker.handlers import Handlers
from services.worker.handoff import PrefillSide
from services.worker.outputs import Background, Outputs
from services.worker.requests import Requests
from tests.engine._sim_support import make_engine, run_to_end, tokens_by_request
from tests.helpers import routed
from tests.worker.fakes import RecordingBus

PROMPT = tuple(b"tell me story number 44")


def spec(attempt: int) -> RequestSpec:
    return RequestSpec(
        model="m",
        prompt_token_ids=PROMPT,
        block_size=4,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=2, seed=44),
        reply_to="i",
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
        attempt=attempt,
    )


def whole_answer() -> bytes:
    engine, request = make_engine(), spec(0)
    engine.add_request(EngineRequest("r", request.prompt_token_ids, request.sampling, ()))
    return bytes(tokens_by_request(run_to_end(engine))["r"])


class Worker:
    """A worker's route handling and engine stepping, publishing to a list."""

    def __init__(self, threaded: bool = False) -> None:
        engine = make_engine()
        if threaded:
            # Stepped on a thread of its own, as an engine that computes for real is: request
            # set changes wait there for the next step.
            engine.capabilities = EngineCapabilities(
                kv_handoff=True, kv_events=True, modelled_time=False
            )
        self.driver = EngineDriver(engine, speedup=1000.0)
        self.bus, background = RecordingBus(), Background()
        outputs = Outputs(cast(Bus, self.bus), "w1", background)
        prefill = PrefillSide(cast(Any, None), self.driver, background)
        self.requests = Requests(self.driver, outputs, prefill, BlobAssembler())
        self._handlers = Handlers("w1", self.requests, prefill, cast(Any, None), ByteTokenizer())
        self._background = background
        # Called with each step's number before its outputs are handed over.
        self.before_outputs: Callable[[int], Awaitable[None]] | None = None

    async def route(self, attempt: int) -> None:
        await self._handlers.on_route(routed("r", "w1", spec(attempt)))

    async def run_until_finished(self, attempt: int) -> None:
        async def on_step(result: StepResult) -> None:
            if self.before_outputs is not None:
                await self.before_outputs(self.driver.steps)
            for output in result.outputs:
                await self.requests.output(output, step=self.driver.steps)

        async def on_error(err: Exception) -> None:
            raise err

        def finished() -> bool:
            return any(
                isinstance(e, RequestFinished) and e.attempt == attempt for e in self.bus.published
            )

        stepping = asyncio.create_task(self.driver.run(on_step, on_error))
        try:
            async with asyncio.timeout(10):
                while not stepping.done() and not finished():
                    await asyncio.sleep(0.01)
        finally:
            stepping.cancel()
            await asyncio.gather(stepping, return_exceptions=True)
        await self._background.finish()

    def batches(self) -> list[TokenRun]:
        return [r for e in self.bus.published if isinstance(e, TokenBatch) for r in e.runs]


@pytest.mark.parametrize("threaded", [False, True])
async def test_a_replaced_attempt_takes_no_output_of_a_step_that_ran_the_old_one(
    threaded: bool,
) -> None:
    worker = Worker(threaded)

    async def before_outputs(step: int) -> None:
        if step == 1:
            # The old attempt's first token is computed; the new attempt's route comes before
            # it is handed over.
            await worker.route(1)

    worker.before_outputs = before_outputs
    await worker.route(0)
    await worker.run_until_finished(1)
    batches = worker.batches()
    assert {b.attempt for b in batches} == {1}
    whole = whole_answer()
    assert b"".join(bytes(b.token_ids) for b in batches) == whole
    assert "".join(b.text for b in batches) == whole.decode()
    assert [b.index for b in batches] == [0, 1]
    finished = next(e for e in worker.bus.published if isinstance(e, RequestFinished))
    assert finished.attempt == 1 and finished.usage.completion_tokens == len(whole)


async def test_a_route_redelivered_after_its_attempt_ended_here_is_not_run_again() -> None:
    worker = Worker()
    await worker.route(0)
    await worker.run_until_finished(0)
    first = len(worker.bus.published)
    await worker.route(0)
    assert not worker.requests.in_flight
    assert len(worker.bus.published) == first
    # A later attempt that comes back here does run.
    await worker.route(1)
    await worker.run_until_finished(1)
    for attempt in (0, 1):
        batches = [b for b in worker.batches() if b.attempt == attempt]
        assert b"".join(bytes(b.token_ids) for b in batches) == whole_answer()


async def test_runs_are_allowed_exactly_while_no_request_held_has_a_stop_string() -> None:
    worker = Worker()
    requests = worker.requests

    def stopping(attempt: int) -> RequestSpec:
        sampling = SamplingParams(max_tokens=2, seed=44, stop=("zz",))
        return spec(attempt).model_copy(update={"sampling": sampling})

    assert requests.runs_allowed()
    await worker._handlers.on_route(routed("r", "w1", stopping(0)))
    assert not requests.runs_allowed()
    await worker.route(1)  # its next attempt, without one, replaces it
    assert requests.runs_allowed()
    await worker._handlers.on_route(routed("r", "w1", stopping(2)))
    assert not requests.runs_allowed()
    await worker.run_until_finished(2)
    assert "r" not in requests.active and requests.runs_allowed()
