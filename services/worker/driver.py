"""Drives an engine's steps in real time: each step's modelled or measured duration is waited
out (divided by the speed-up), and an engine that computes for real (no ``modelled_time``) steps
on a thread of its own so that the bus keeps flowing meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.engine.protocol import (
    Engine,
    EngineRequest,
    StepResult,
    decode_runs,
    kv_portable,
    whole_prompt_handoff,
)

_T = TypeVar("_T")


class EngineDriver:
    def __init__(
        self,
        engine: Engine,
        speedup: float,
        run_s: float = 0.0,
        runs_allowed: Callable[[], bool] = lambda: True,
    ) -> None:
        """``run_s``: plain decode steps that together take at most this long (wall seconds)
        are done at once where the engine can (:class:`DecodeRuns`) and ``runs_allowed()``
        says so, their wait and their outputs one: a modelled engine at a high speed-up spends
        most of a step on the step's own bookkeeping. 0: one step at a time."""
        self.engine = engine
        self._speedup = speedup
        self._runs = decode_runs(engine) if run_s > 0 else None
        self._run_s = run_s
        self._runs_allowed = runs_allowed
        # Seconds spent stepping, for the load reports, and the last step's.
        self.busy_s = 0.0
        self.last_step_s = 0.0
        self._ops: list[Callable[[], object]] = []
        # Steps begun so far: a request set change made now is first seen by step `steps + 1`,
        # and the result handed to `run`'s `on_step` is that of step `steps`.
        self.steps = 0
        # Requests the engine would not take, to fail from the event loop.
        self._refused: list[tuple[str, str]] = []
        self._wake = asyncio.Event()
        self._thread = (
            None
            if engine.capabilities.modelled_time
            else ThreadPoolExecutor(1, thread_name_prefix="engine")
        )
        # The engine, if its KV can move to another engine (disaggregation).
        self.portable = kv_portable(engine)
        self._whole_prompt = whole_prompt_handoff(engine)

    def op(self, op: Callable[[], object]) -> None:
        """Change the engine's request set. An engine whose steps run on the step thread is only
        ever touched from that thread: the change waits there for the next step."""
        if self._thread is None:
            op()
        else:
            self._ops.append(op)

    async def call(self, call: Callable[[], _T]) -> _T:
        """Call into the engine between steps, on the thread its steps run on."""
        if self._thread is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def add(self, request: EngineRequest, handed_off: int = 0) -> None:
        """Give the engine a request; a refusal is kept for :meth:`take_refused`. Runs where
        engine ops run. ``handed_off``: a hand-off's continuation, whose first ``handed_off``
        prompt tokens' KV was imported; an engine that takes a whole prompt recomputes none of
        them, any other its partial last block."""
        try:
            if handed_off and self._whole_prompt is not None:
                self._whole_prompt.add_handed_off(request, handed_off)
            else:
                self.engine.add_request(request)
        except ValueError as err:  # e.g. larger than the whole KV cache: it can never run here
            self._refused.append((request.request_id, str(err)))

    def take_refused(self) -> list[tuple[str, str]]:
        """The (request id, why) of the requests the engine refused since the last call."""
        refused, self._refused = self._refused, []
        return refused

    def abort(self, request_id: str) -> None:
        self.op(lambda: self.engine.abort(request_id))

    def wake(self) -> None:
        """There is work: step."""
        self._wake.set()

    def _step(self) -> StepResult:
        ops, self._ops = self._ops, []
        for op in ops:
            op()
        if self._runs is not None and self._runs_allowed():
            run = self._runs.run_steps(self._run_s * self._speedup)
            if run is not None:
                self.steps += len(run.step_ends_s)
                return run
        self.steps += 1
        return self.engine.step()

    async def run(
        self,
        on_step: Callable[[StepResult], Coroutine[object, object, None]],
        on_error: Callable[[Exception], Coroutine[object, object, None]],
        on_idle: Callable[[], Coroutine[object, object, None]] | None = None,
    ) -> None:
        """Step while there is work, waiting out each step's duration, then hand its result to
        ``on_step``; a failed step goes to ``on_error`` and stepping goes on. ``on_idle``: called
        each time the engine runs out of work, before waiting for more."""
        loop = asyncio.get_running_loop()
        while True:
            if not (self._ops or self.engine.has_work()):
                self._wake.clear()
                if on_idle is not None:
                    await on_idle()
                if not self._wake.is_set():
                    await self._wake.wait()
                continue
            started = loop.time()
            try:
                if self._thread is None:
                    result = self._step()
                else:
                    result = await loop.run_in_executor(self._thread, self._step)
            except Exception as err:  # the engine failed: end what it held, keep serving
                await on_error(err)
                continue
            remaining = result.duration_s / self._speedup - (loop.time() - started)
            # Sleeping (even zero) also lets the bus deliver new routes between steps.
            await asyncio.sleep(max(0.0, remaining))
            self.last_step_s = loop.time() - started
            self.busy_s += self.last_step_s
            await on_step(result)
