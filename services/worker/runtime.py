"""The worker process around an engine: takes routed requests from the bus, drives the engine's
steps in real time, and publishes tokens, terminal events, KV events and load reports.

Both worker services (prefill and decode) run this with their own role.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span

from bus.client import Bus
from bus.registry import LeasedKey, RoleChanged
from bus.topology import Subjects, worker_routes
from observability.tracing import context_of, trace_context
from schemas.events import (
    CancellationRequested,
    Envelope,
    Event,
    FailureCode,
    PrefillCompleted,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    Role,
    RouteDecided,
    TokensGenerated,
    Usage,
    WorkerLoadReported,
)
from schemas.latency import LatencyHistogram
from schemas.messages import WorkerRegistration
from services.common.kv_transfer import KvTransferModel
from services.common.tokenizer import IncrementalDetokenizer, Tokenizer
from services.engine.kv_events import kv_event
from services.engine.protocol import (
    Engine,
    EngineRequest,
    KvChange,
    KvPortable,
    RequestOutput,
    StepResult,
)
from services.worker.handoff import KvReceiver, KvSender, PrefillJob, continuation

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# How long a cancellation for a request this worker has not (yet) seen is remembered: the
# cancel may overtake the route decision on its way here.
EARLY_CANCEL_MEMORY_S = 60.0


@dataclass
class WorkerOptions:
    worker_id: str
    role: Role
    engine_kind: str
    model: str
    speedup: float
    lease_ttl_s: int
    load_report_interval_s: float
    drain_timeout_s: float
    kv_events: bool = True
    # Run engine steps on a thread of their own (engines that compute for real).
    step_thread: bool = False
    # Seconds a request's tokens may be held back to go out together (0: every step).
    stream_interval_s: float = 0.02
    # While busy, a report at most this often (seconds): the planner's queue estimates are only
    # as fresh as the last report.
    busy_report_interval_s: float = 0.05
    # What a sim decode worker waits out for a hand-off's KV (a real engine's bytes take what
    # they take).
    kv_transfer: KvTransferModel = field(default_factory=KvTransferModel)
    # A decode worker waits for a remote prefill's KV this long, at least, or this many times
    # the planner's prediction, before it prefills locally instead.
    handoff_timeout_s: float = 5.0
    handoff_timeout_factor: float = 3.0


@dataclass
class _Awaiting:
    """A decode-side request whose prompt a prefill worker is computing."""

    prefill_worker_id: str
    # Leading prompt blocks this worker cached when the planner decided.
    cached_blocks: int
    timer: asyncio.Task[None] | None = None
    # The KV is on its way in: the deadline no longer applies.
    receiving: bool = False


@dataclass
class _Active:
    spec: RequestSpec
    session_id: str | None
    detok: IncrementalDetokenizer
    span: Span
    received: float
    first_token: float | None = None
    # Tokens published so far, and those generated but not yet published.
    emitted: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    flushed_at: float = 0.0
    cached_tokens: int = 0
    awaiting: _Awaiting | None = None
    last_token: float | None = None
    token_gaps: LatencyHistogram = field(default_factory=LatencyHistogram)
    stalled_gaps: int = 0
    prefilled_by: str | None = None


class Worker:
    def __init__(
        self, bus: Bus, engine: Engine, tokenizer: Tokenizer, options: WorkerOptions
    ) -> None:
        self._bus = bus
        self._engine = engine
        self._tokenizer = tokenizer
        self._opt = options
        self._source = f"worker/{options.worker_id}"
        self._active: dict[str, _Active] = {}
        self._prefills: dict[str, PrefillJob] = {}
        self._sender = KvSender(bus, options.worker_id, self._source, engine.block_size)
        self._receiver = KvReceiver(
            engine.block_size,
            options.kv_transfer,
            options.speedup,
            options.handoff_timeout_s,
            options.handoff_timeout_factor,
        )
        self._early_cancels: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._kv_seq = 0
        self._busy_s = 0.0
        self._ops: list[Callable[[], object]] = []
        # Requests the engine would not take, to fail from the event loop.
        self._refused: list[tuple[str, str]] = []
        self._step_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="engine") if options.step_thread else None
        )
        self._reported_at = 0.0
        self._lease: LeasedKey | None = None
        # The role the capacity loop gave this worker, taken once in-flight work is done.
        self._next_role: Role | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._tracer = trace.get_tracer("laneway.worker")

    def registration(self) -> WorkerRegistration:
        return WorkerRegistration(
            worker_id=self._opt.worker_id,
            role=self._opt.role,
            engine=self._opt.engine_kind,
            model=self._opt.model,
            block_size=self._engine.block_size,
            kv_blocks_total=self._engine.kv_blocks_total,
            max_num_seqs=self._engine.max_num_seqs,
            kv_events=self._opt.kv_events,
            kv_handoff=self._portable is not None,
            draining=self._next_role is not None,
            pid=os.getpid(),
        )

    @property
    def _portable(self) -> KvPortable | None:
        engine = self._engine
        ok = hasattr(engine, "export_prefix") and hasattr(engine, "import_prefix")
        return engine if ok else None  # type: ignore[return-value]

    async def run(
        self,
        lease: LeasedKey,
        stop: asyncio.Event,
        watch_role: Callable[[RoleChanged], Coroutine[object, object, None]] | None = None,
    ) -> None:
        self._lease = lease
        await lease.start()
        await self._bus.subscribe(Subjects.cancellation_requested, self._on_cancel)
        await self._bus.subscribe_bytes(
            Subjects.kv_handoff(self._opt.worker_id), self._receiver.blobs.on_msg
        )
        await self._bus.consume(worker_routes(self._opt.worker_id), self._on_route)
        loops = [
            asyncio.create_task(self._step_loop(), name="engine-steps"),
            asyncio.create_task(self._report_loop(), name="load-reports"),
        ]
        if watch_role is not None:
            loops.append(asyncio.create_task(watch_role(self._on_role), name="role-watch"))
        log.info("worker %s (%s) ready", self._opt.worker_id, self._opt.role)
        await stop.wait()
        # Leave the pool first so that no new work is routed here, then let in-flight work end.
        await lease.stop()
        deadline = time.monotonic() + self._opt.drain_timeout_s
        while (self._active or self._prefills) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._active):
            await self._fail(request_id, "worker shut down before the request finished")
        for request_id in list(self._prefills):
            self._prefill_failed(request_id, "prefill worker shut down")
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, *self._background, return_exceptions=True)

    # -- role changes ---------------------------------------------------------------------

    async def _on_role(self, role: Role) -> None:
        """Leave the old role's pool at once (draining: no new work), finish what is in flight,
        then join the new one."""
        if role == (self._next_role or self._opt.role):
            return
        switching = self._next_role is not None
        self._next_role = role
        await self._register()
        if not switching:
            self._spawn(self._switch_when_idle())

    async def _switch_when_idle(self) -> None:
        while self._active or self._prefills:
            await asyncio.sleep(0.05)
        assert self._next_role is not None
        log.info("worker %s: role %s → %s", self._opt.worker_id, self._opt.role, self._next_role)
        self._opt.role, self._next_role = self._next_role, None
        await self._register()
        await self._report_load()

    async def _register(self) -> None:
        if self._lease is not None:
            await self._lease.update(self.registration().model_dump_json().encode())

    # -- inputs ---------------------------------------------------------------------------

    async def _on_route(self, event: Event) -> None:
        if isinstance(event, PrefillCompleted):
            self._on_prefilled(event)
            return
        if not isinstance(event, RouteDecided) or event.request_id is None:
            return
        request_id = event.request_id
        if request_id in self._active or request_id in self._prefills:  # a redelivery
            return
        remote = event.prefill.prefill_worker_id if event.prefill is not None else None
        if remote == self._opt.worker_id and event.worker_id != self._opt.worker_id:
            await self._start_prefill(event)
            return
        span = self._tracer.start_span("worker.generate", context=context_of(event))
        span.set_attribute("laneway.request_id", request_id)
        span.set_attribute("laneway.worker_id", self._opt.worker_id)
        state = _Active(
            spec=event.spec,
            session_id=event.session_id,
            detok=IncrementalDetokenizer(self._tokenizer, event.spec.sampling.stop),
            span=span,
            received=time.monotonic(),
        )
        self._active[request_id] = state
        if self._early_cancels.pop(request_id, None) is not None:
            await self._cancelled(request_id, "client_disconnected")
            return
        if remote is not None and event.prefill is not None:
            self._await_prefill(request_id, state, event)
            return
        await self._admit_now(self._engine_request(request_id, event.spec))

    def _block_hashes(self, spec: RequestSpec) -> tuple[int, ...]:
        return spec.block_hashes if spec.block_size == self._engine.block_size else ()

    def _engine_request(self, request_id: str, spec: RequestSpec) -> EngineRequest:
        return EngineRequest(
            request_id, spec.prompt_token_ids, spec.sampling, self._block_hashes(spec)
        )

    async def _admit_now(self, request: EngineRequest) -> None:
        self._engine_op(lambda: self._admit(request))
        await self._fail_refused()
        self._wake.set()

    def _spawn(self, work: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- disaggregation: the prefill side --------------------------------------------------

    async def _start_prefill(self, event: RouteDecided) -> None:
        assert event.request_id is not None
        request_id = event.request_id
        if self._early_cancels.pop(request_id, None) is not None:
            return
        span = self._tracer.start_span("worker.prefill", context=context_of(event))
        span.set_attribute("laneway.request_id", request_id)
        span.set_attribute("laneway.decode_worker_id", event.worker_id)
        hashes = self._block_hashes(event.spec)
        self._prefills[request_id] = PrefillJob(event.worker_id, hashes, span, event.session_id)
        # The first token is sampled here exactly as the aggregated path would sample it.
        one = event.spec.sampling.model_copy(update={"max_tokens": 1})
        await self._admit_now(EngineRequest(request_id, event.spec.prompt_token_ids, one, hashes))

    async def _prefill_done(self, output: RequestOutput) -> None:
        """Runs between steps, so the prompt's blocks are still cached when they are exported."""
        request_id = output.request_id
        job = self._prefills.pop(request_id)
        portable = self._portable
        assert portable is not None
        try:
            _, data = await self._on_engine(lambda: portable.export_prefix(job.block_hashes))
        except Exception as err:  # export is best effort: the decode worker then prefills
            log.exception("KV export of %s failed", request_id)
            self._prefill_failed(request_id, f"KV export failed: {err}", job)
            return
        job.span.end()
        self._spawn(self._sender.hand_off(request_id, job, output, data))

    def _prefill_failed(self, request_id: str, message: str, job: PrefillJob | None = None) -> None:
        job = job or self._prefills.pop(request_id)
        self._abort(request_id)
        job.span.set_attribute("laneway.failed", message)
        job.span.end()
        self._spawn(self._sender.failed(request_id, job, message))

    # -- disaggregation: the decode side ---------------------------------------------------

    def _await_prefill(self, request_id: str, state: _Active, event: RouteDecided) -> None:
        placement = event.prefill
        assert placement is not None and placement.prefill_worker_id is not None
        me = self._opt.worker_id
        cached = next((c.cached_blocks for c in event.candidates if c.worker_id == me), 0)
        state.awaiting = _Awaiting(placement.prefill_worker_id, cached)
        timeout = self._receiver.deadline_s(placement)
        state.awaiting.timer = self._spawn(self._handoff_deadline(request_id, timeout))

    def _on_prefilled(self, event: PrefillCompleted) -> None:
        request_id = event.request_id or ""
        state = self._active.get(request_id)
        awaiting = state.awaiting if state is not None else None
        if state is None or awaiting is None or awaiting.receiving:
            self._receiver.blobs.drop(request_id)  # fell back, cancelled, or a redelivery
            return
        if event.error is not None or event.first_token_id is None:
            self._fall_back(request_id, state, f"remote prefill failed: {event.error}")
            return
        awaiting.receiving = True
        if awaiting.timer is not None:
            awaiting.timer.cancel()
        self._spawn(self._receive_kv(request_id, state, event))

    async def _receive_kv(self, request_id: str, state: _Active, event: PrefillCompleted) -> None:
        started = time.monotonic()
        cached = state.awaiting.cached_blocks if state.awaiting is not None else 0
        try:
            data = await self._receiver.receive(event, cached)
        except ValueError as err:
            if self._active.get(request_id) is state:
                self._fall_back(request_id, state, f"KV hand-off failed: {err}")
            return
        if self._active.get(request_id) is not state:  # cancelled meanwhile
            return
        state.awaiting = None
        state.prefilled_by = event.worker_id
        transferred = self._receiver.transferred(
            event, self._opt.worker_id, self._source, state.span, started
        )
        self._spawn(
            self._bus.publish(
                Subjects.kv_transferred(self._opt.worker_id), transferred, durable=False
            )
        )
        first, rest = continuation(request_id, state.spec, event)
        await self._on_output(first)
        if rest is None or request_id not in self._active:  # the first token was the last
            return
        portable = self._portable
        hashes = event.block_hashes

        def adopt_and_admit() -> None:
            try:
                if portable is not None:
                    portable.import_prefix(hashes, data)
            except Exception:  # unusable KV costs a local prefill, never the request
                log.exception("KV import of %s failed; prefilling locally", request_id)
            self._admit(rest)

        self._engine_op(adopt_and_admit)
        await self._fail_refused()
        self._wake.set()

    async def _handoff_deadline(self, request_id: str, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        state = self._active.get(request_id)
        if state is not None and state.awaiting is not None and not state.awaiting.receiving:
            state.awaiting.timer = None
            self._fall_back(request_id, state, f"no KV hand-off within {timeout_s:.1f} s")

    def _fall_back(self, request_id: str, state: _Active, why: str) -> None:
        log.warning("request %s: %s; prefilling locally", request_id, why)
        state.span.set_attribute("laneway.handoff_fallback", why)
        if state.awaiting is not None and state.awaiting.timer is not None:
            state.awaiting.timer.cancel()
        state.awaiting = None
        self._receiver.blobs.drop(request_id)
        self._spawn(self._admit_now(self._engine_request(request_id, state.spec)))

    async def _on_cancel(self, event: Event) -> None:
        if not isinstance(event, CancellationRequested) or event.request_id is None:
            return
        prefill = self._prefills.pop(event.request_id, None)
        if prefill is not None:  # the decode worker holds the request and ends it
            self._abort(event.request_id)
            prefill.span.end()
            return
        if event.request_id in self._active:
            self._abort(event.request_id)
            await self._cancelled(event.request_id, event.reason)
            return
        now = time.monotonic()
        self._early_cancels[event.request_id] = now
        for request_id, at in list(self._early_cancels.items()):
            if now - at > EARLY_CANCEL_MEMORY_S:
                del self._early_cancels[request_id]

    # -- the engine, in real time ----------------------------------------------------------

    def _engine_op(self, op: Callable[[], object]) -> None:
        """Change the engine's request set. An engine whose steps run on the step thread is only
        ever touched from that thread: the change waits there for the next step."""
        if self._step_thread is None:
            op()
        else:
            self._ops.append(op)

    async def _on_engine(self, call: Callable[[], _T]) -> _T:
        """Call into the engine between steps, on the thread its steps run on."""
        if self._step_thread is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._step_thread, call)

    def _admit(self, request: EngineRequest) -> None:
        try:
            self._engine.add_request(request)
        except ValueError as err:  # e.g. larger than the whole KV cache: it can never run here
            self._refused.append((request.request_id, str(err)))

    async def _engine_failed(self, err: Exception) -> None:
        # An engine may say which request failed (a `request_id` on the error); otherwise every
        # request it held is lost with the step.
        log.exception("engine step failed")
        failed = getattr(err, "request_id", None)
        known = failed in self._active or failed in self._prefills
        victims = [failed] if known else [*self._active, *self._prefills]
        for request_id in victims:
            if request_id in self._prefills:
                self._prefill_failed(request_id, f"engine error: {err}")
            elif request_id in self._active and self._active[request_id].awaiting is None:
                await self._fail(request_id, f"engine error: {err}")

    async def _fail_refused(self) -> None:
        refused, self._refused = self._refused, []
        for request_id, message in refused:
            if request_id in self._prefills:
                self._prefill_failed(request_id, message)
            elif request_id in self._active:
                await self._fail(request_id, message, "invalid_request")

    def _abort(self, request_id: str) -> None:
        self._engine_op(lambda: self._engine.abort(request_id))

    def _step(self) -> StepResult:
        ops, self._ops = self._ops, []
        for op in ops:
            op()
        return self._engine.step()

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._ops or self._engine.has_work()):
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            try:
                if self._step_thread is None:
                    result = self._step()
                else:
                    # Real compute: off the event loop, so that the bus keeps flowing meanwhile.
                    result = await loop.run_in_executor(self._step_thread, self._step)
            except Exception as err:  # the engine failed: end what it held, keep serving
                await self._engine_failed(err)
                continue
            remaining = result.duration_s / self._opt.speedup - (loop.time() - started)
            # Sleeping (even zero) also lets the bus deliver new routes between steps.
            await asyncio.sleep(max(0.0, remaining))
            self._busy_s += loop.time() - started
            await self._fail_refused()
            for output in result.outputs:
                await self._on_output(output, stalled=result.prefill_tokens > 0)
            if result.kv_changes and self._opt.kv_events:
                await self._publish_kv(result.kv_changes)
            if loop.time() - self._reported_at >= self._opt.busy_report_interval_s:
                await self._report_load()

    async def _on_output(self, output: RequestOutput, stalled: bool = False) -> None:
        """``stalled``: the step that produced it also computed prompt tokens."""
        if output.request_id in self._prefills:
            if output.finished:
                await self._prefill_done(output)
            return
        state = self._active.get(output.request_id)
        if state is None:  # cancelled while the step ran
            return
        now = time.monotonic()
        if state.first_token is None:
            state.first_token = now
            state.cached_tokens = output.cached_tokens or 0
        elif state.last_token is not None and output.new_token_ids:
            state.token_gaps.add((now - state.last_token) * 1000)
            state.stalled_gaps += stalled
        if output.new_token_ids:
            state.last_token = now
        state.pending_ids += output.new_token_ids
        state.pending_text += state.detok.push(output.new_token_ids)
        finished = output.finished or state.detok.stopped
        if finished and not state.detok.stopped:
            state.pending_text += state.detok.flush()
        # The first token goes out at once (it is the TTFT), the last with the end; between,
        # tokens are coalesced for `stream_interval_s` so that a long answer is not one message
        # per step per request.
        if state.pending_ids and (
            finished or state.emitted == 0 or now - state.flushed_at >= self._opt.stream_interval_s
        ):
            await self._flush_tokens(output.request_id, state, now)
        if not finished:
            return
        if not output.finished:  # a stop string ended it before the engine did
            self._abort(output.request_id)
        reason = "stop" if state.detok.stopped else (output.finish_reason or "length")
        del self._active[output.request_id]
        finished_event = RequestFinished(
            source=self._source,
            request_id=output.request_id,
            session_id=state.session_id,
            trace=trace_context(state.span),
            worker_id=self._opt.worker_id,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=len(state.spec.prompt_token_ids),
                completion_tokens=state.emitted,
                cached_tokens=state.cached_tokens,
            ),
            ttft_ms=((state.first_token or now) - state.received) * 1000,
            e2e_ms=(now - state.received) * 1000,
            token_gaps=state.token_gaps,
            stalled_gaps=state.stalled_gaps,
            prefill_worker_id=state.prefilled_by,
        )
        state.span.set_attribute("laneway.completion_tokens", state.emitted)
        state.span.end()
        self._publish_terminal(state, finished_event)

    # -- outputs ---------------------------------------------------------------------------

    async def _flush_tokens(self, request_id: str, state: _Active, now: float) -> None:
        await self._bus.publish(
            Subjects.tokens(state.spec.reply_to),
            TokensGenerated(
                source=self._source,
                request_id=request_id,
                session_id=state.session_id,
                worker_id=self._opt.worker_id,
                index=state.emitted,
                token_ids=tuple(state.pending_ids),
                text=state.pending_text,
            ),
            durable=False,
        )
        state.emitted += len(state.pending_ids)
        state.pending_ids, state.pending_text, state.flushed_at = [], "", now

    def _publish_terminal(self, state: _Active, event: Envelope) -> None:
        # Awaiting JetStream's ack here would stall every other request's next step; the
        # publish is queued on the connection behind this request's token deltas, so order holds.
        if state.awaiting is not None:
            if state.awaiting.timer is not None:
                state.awaiting.timer.cancel()
            self._receiver.blobs.drop(event.request_id or "")
        self._spawn(self._bus.publish(Subjects.request_terminal(state.spec.reply_to), event))

    async def _cancelled(self, request_id: str, reason: str) -> None:
        state = self._active.pop(request_id)
        state.span.set_attribute("laneway.cancelled", reason)
        state.span.end()
        self._publish_terminal(
            state,
            RequestCancelled(
                source=self._source,
                request_id=request_id,
                session_id=state.session_id,
                trace=trace_context(state.span),
                worker_id=self._opt.worker_id,
                reason=reason,
                completion_tokens=state.emitted,
            ),
        )

    async def _fail(
        self, request_id: str, message: str, code: FailureCode = "engine_error"
    ) -> None:
        self._abort(request_id)
        state = self._active.pop(request_id)
        state.span.set_attribute("laneway.failed", message)
        state.span.end()
        self._publish_terminal(
            state,
            RequestFailed(
                source=self._source,
                request_id=request_id,
                session_id=state.session_id,
                trace=trace_context(state.span),
                code=code,
                message=message,
                worker_id=self._opt.worker_id,
            ),
        )

    async def _publish_kv(self, changes: list[KvChange]) -> None:
        subject = Subjects.kv(self._opt.worker_id)
        for change in changes:
            self._kv_seq += 1
            # Per-worker order is what the index needs; one connection preserves it.
            await self._bus.publish(
                subject, kv_event(change, self._opt.worker_id, self._kv_seq), durable=False
            )

    async def _report_loop(self) -> None:
        while True:
            await self._report_load()
            await asyncio.sleep(self._opt.load_report_interval_s)

    async def _report_load(self) -> None:
        self._reported_at = asyncio.get_running_loop().time()
        load = self._engine.load()
        await self._bus.publish(
            Subjects.load(self._opt.worker_id),
            WorkerLoadReported(
                source=self._source,
                worker_id=self._opt.worker_id,
                role=self._opt.role,
                running=load.running,
                waiting=load.waiting,
                waiting_prefill_tokens=load.waiting_prefill_tokens,
                kv_blocks_used=load.kv_blocks_used,
                kv_blocks_total=load.kv_blocks_total,
                busy_s=self._busy_s,
            ),
            durable=False,
        )
