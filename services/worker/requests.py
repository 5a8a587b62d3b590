"""The requests a worker holds, and how each one ends: the outputs of one it serves become token
chunks and a terminal event, or it is cancelled or fails; one it prefills for another worker
ends with the hand-off."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from bus.blobs import BlobAssembler
from observability.tracing import trace_context
from schemas.block_hash import salt_root
from schemas.events import (
    FailureCode,
    RequestCancelled,
    RequestFailed,
    RequestSpec,
    TerminalEvent,
)
from services.engine.protocol import EngineRequest, RequestOutput
from services.worker.driver import EngineDriver
from services.worker.handoff import PrefillJob, PrefillSide
from services.worker.outputs import Outputs
from services.worker.stream import RequestStream

log = logging.getLogger(__name__)


@dataclass
class Awaiting:
    """A decode-side request whose prompt a prefill worker is computing."""

    prefill_worker_id: str
    # Leading prompt blocks this worker cached when the planner decided.
    cached_blocks: int
    # The wait's span, from the decision to the prefill worker's answer (or giving up on it).
    span: Span
    timer: asyncio.Task[None] | None = None
    # The KV is on its way in: the deadline no longer applies.
    receiving: bool = False

    def settle(self, outcome: str) -> None:
        """End the wait, once, saying how it ended."""
        if self.span.is_recording():
            self.span.set_attribute("laneway.outcome", outcome)
            self.span.end()


@dataclass
class Active:
    """A request this worker streams the answer of."""

    spec: RequestSpec
    session_id: str | None
    span: Span
    stream: RequestStream
    awaiting: Awaiting | None = None
    prefilled_by: str | None = None
    first_step: int = sys.maxsize
    """The first engine step that runs this request (set once the engine has it): an earlier
    step's output under its id is of an attempt it replaced here."""


class Requests:
    def __init__(
        self, driver: EngineDriver, outputs: Outputs, prefill: PrefillSide, blobs: BlobAssembler
    ) -> None:
        self._driver = driver
        self._outputs = outputs
        self._prefill = prefill
        # Hand-off KV still arriving for a request that ends.
        self._blobs = blobs
        # Held by `hold` and let go by `_drop` alone, which keep `_with_stops` beside it.
        self.active: dict[str, Active] = {}
        self.prefills: dict[str, PrefillJob] = {}
        # The active requests with stop strings: asked at every step, so counted, not scanned.
        self._with_stops: set[str] = set()

    def hold(self, request_id: str, state: Active) -> None:
        """Serve ``request_id``; what it publishes is kept for resend queries from now on."""
        self.active[request_id] = state
        if state.spec.sampling.stop:
            self._with_stops.add(request_id)
        else:  # it may replace an attempt that had some
            self._with_stops.discard(request_id)
        self._outputs.kept.started(request_id, state.spec.attempt)

    def _drop(self, request_id: str) -> Active:
        self._with_stops.discard(request_id)
        return self.active.pop(request_id)

    def forget(self, request_id: str) -> None:
        """Let go of a request without ending it: another attempt of it replaces it here."""
        state = self._drop(request_id)
        state.span.end()
        if state.awaiting is not None:
            state.awaiting.settle("replaced")
            if state.awaiting.timer is not None:
                state.awaiting.timer.cancel()
        self._outputs.kept.forget(request_id)

    def runs_allowed(self) -> bool:
        """Whether the engine may do several decode steps at once: a stop string must see its
        request's tokens one step at a time, or the step it ends the answer at is overrun."""
        return not self._with_stops

    def holds(self, request_id: str) -> bool:
        return request_id in self.active or request_id in self.prefills

    def ran(self, request_id: str, attempt: int) -> bool:
        """``attempt`` of the request, or a later one, ended here not long ago."""
        kept = self._outputs.kept.attempt(request_id)
        return kept is not None and kept >= attempt

    @property
    def in_flight(self) -> bool:
        return bool(self.active or self.prefills)

    def engine_request(self, request_id: str, spec: RequestSpec) -> EngineRequest:
        return EngineRequest(
            request_id,
            spec.prompt_token_ids,
            spec.sampling,
            self.block_hashes(spec),
            salt_root(spec.cache_salt),
            spec.lora,
            spec.lora_path,
        )

    def block_hashes(self, spec: RequestSpec) -> tuple[int, ...]:
        return spec.block_hashes if spec.block_size == self._driver.engine.block_size else ()

    async def admit(
        self,
        request: EngineRequest,
        before: Callable[[], bool] | None = None,
        handed_off: int = 0,
    ) -> None:
        """Give the engine ``request``, after ``before`` (an engine op: a hand-off's KV import,
        true if the KV was taken); ``handed_off``: the leading prompt tokens that KV covers."""
        state = self.active.get(request.request_id)

        def add() -> None:
            taken = before() if before is not None else True
            self._driver.add(request, handed_off if taken else 0)
            if state is not None:
                state.first_step = self._driver.steps + 1

        self._driver.op(add)
        await self.fail_refused()
        self._driver.wake()

    def abort(self, request_id: str) -> None:
        self._driver.abort(request_id)

    async def fail_refused(self) -> None:
        for request_id, message in self._driver.take_refused():
            if request_id in self.prefills:
                self.prefill_failed(request_id, message)
            elif request_id in self.active:
                await self.fail(request_id, message, "invalid_request")

    async def engine_failed(self, err: Exception) -> None:
        # An engine may say which request failed (a `request_id` on the error); otherwise every
        # request it held is lost with the step.
        log.exception("engine step failed")
        failed: str | None = getattr(err, "request_id", None)
        victims = (
            [failed]
            if failed is not None and self.holds(failed)
            else [*self.active, *self.prefills]
        )
        for request_id in victims:
            if request_id in self.prefills:
                self.prefill_failed(request_id, f"engine error: {err}")
            elif request_id in self.active and self.active[request_id].awaiting is None:
                await self.fail(request_id, f"engine error: {err}")

    async def output(
        self,
        output: RequestOutput,
        stalled: bool = False,
        step: int | None = None,
        times: tuple[float, ...] = (),
    ) -> None:
        """``stalled``: the step that produced it also computed prompt tokens; ``step``: that
        step's number (None: not an engine step's, a hand-off's first token); ``times``: when
        each of its tokens came, where it holds several steps' (see ``RequestStream.push``)."""
        request_id = output.request_id
        if request_id in self.prefills:
            if output.finished:
                await self._prefill.done(request_id, self.prefills.pop(request_id), output)
            return
        state = self.active.get(request_id)
        if state is None:  # cancelled while the step ran
            return
        if step is not None and step < state.first_step:
            # The step ran the attempt this one replaced (its route came while the step ran):
            # its token is not this attempt's, whose answer would repeat it.
            return
        chunk = state.stream.push(output, time.monotonic(), stalled, times)
        if chunk is not None:
            self._outputs.tokens(state.spec, request_id, chunk)
        if not state.stream.finished:
            return
        if not output.finished:  # a stop string ended it before the engine did
            self._driver.abort(request_id)
        self._drop(request_id)
        finished = state.stream.finished_event(
            self._outputs.source,
            request_id,
            state.session_id,
            trace_context(state.span),
            self._outputs.worker_id,
            state.prefilled_by,
            state.spec.attempt,
            (state.spec.tenant, state.spec.model),
        )
        state.span.set_attribute("laneway.completion_tokens", state.stream.emitted)
        state.span.end()
        self._terminal(state, finished)

    async def cancelled(self, request_id: str, reason: str) -> None:
        state = self._end(request_id, "laneway.cancelled", reason)
        stream = state.stream
        # Charged what was computed: its prompt once it produced a token, and those tokens.
        computed = stream.emitted > 0
        self._terminal(
            state,
            RequestCancelled(
                **self._about(request_id, state),
                reason=reason,
                completion_tokens=stream.emitted,
                prompt_tokens=stream.prompt_tokens if computed else 0,
                cached_tokens=stream.cached_tokens if computed else 0,
                tenant=state.spec.tenant,
                model=state.spec.model,
            ),
        )

    async def fail(self, request_id: str, message: str, code: FailureCode = "engine_error") -> None:
        self._driver.abort(request_id)
        state = self._end(request_id, "laneway.failed", message)
        self._terminal(
            state,
            RequestFailed(
                **self._about(request_id, state),
                code=code,
                message=message,
                completion_tokens=state.stream.emitted,
            ),
        )

    def prefill_failed(self, request_id: str, message: str) -> None:
        self._prefill.failed(request_id, self.prefills.pop(request_id), message)

    def prefill_cancelled(self, request_id: str) -> bool:
        """Stop prefilling a cancelled request (its decode worker ends it); False if this worker
        does not prefill it."""
        job = self.prefills.pop(request_id, None)
        if job is None:
            return False
        self._driver.abort(request_id)
        job.span.end()
        return True

    async def end_all(self) -> None:
        """End every request still held: the worker stops. ``worker_lost`` has the ingress
        continue each on another worker."""
        for request_id in list(self.active):
            await self.fail(request_id, "the worker stopped before the answer ended", "worker_lost")
        for request_id in list(self.prefills):
            self.prefill_failed(request_id, "prefill worker shut down")
        await self._outputs.flush()

    def _end(self, request_id: str, attribute: str, why: str) -> Active:
        """Let go of a request that ends before its answer does, saying why on its span."""
        state = self._drop(request_id)
        state.span.set_attribute(attribute, why)
        state.span.end()
        return state

    def _about(self, request_id: str, state: Active) -> dict[str, Any]:
        """The fields every terminal event of this worker's request carries."""
        return {
            "source": self._outputs.source,
            "request_id": request_id,
            "session_id": state.session_id,
            "trace": trace_context(state.span),
            "worker_id": self._outputs.worker_id,
            "attempt": state.spec.attempt,
        }

    def _terminal(self, state: Active, event: TerminalEvent) -> None:
        if state.awaiting is not None:
            state.awaiting.settle(event.type)
            if state.awaiting.timer is not None:
                state.awaiting.timer.cancel()
            self._blobs.drop(event.request_id or "")
        self._outputs.terminal(state.spec.reply_to, event)
