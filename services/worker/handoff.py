"""A worker's two ends of a KV hand-off (disaggregation). As a prefill worker it computes a
prompt for another worker and sends its KV (chunks on core NATS, then ``PrefillCompleted``); as a
decode worker it takes that KV whole and intact, or reports why not (``decode_side`` continues the
request from the first token)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span
from prometheus_client import Counter

from bus.blobs import BlobAssembler, send_blob
from bus.client import Bus
from bus.topology import Subjects
from observability.tracing import context_of, trace_context
from schemas.block_hash import salt_root
from schemas.events import (
    FinishReason,
    KvTransferred,
    PrefillCompleted,
    PrefillPlacement,
    RouteDecided,
)
from services.common.kv_transfer import KvTransferModel
from services.engine.continuation import handoff_tokens
from services.engine.protocol import EngineRequest, RequestOutput
from services.worker.driver import EngineDriver
from services.worker.outputs import Background

log = logging.getLogger(__name__)


@dataclass
class PrefillJob:
    """A prompt this worker computes for another worker, which will decode it."""

    decode_worker_id: str
    block_hashes: tuple[int, ...]
    span: Span
    session_id: str | None


class KvSender:
    def __init__(
        self, bus: Bus, worker_id: str, source: str, block_size: int, handoffs: Counter
    ) -> None:
        """``handoffs``: counts the hand-offs sent, by side and outcome."""
        self._bus = bus
        self._handoffs = handoffs
        self._worker_id = worker_id
        self._source = source
        self._block_size = block_size

    async def hand_off(
        self, request_id: str, job: PrefillJob, output: RequestOutput, data: bytes, span: Span
    ) -> None:
        """``data``: the prompt's KV as the engine exported it (empty: the engine models KV);
        ``span``: the send's, ended once ``PrefillCompleted`` is out."""
        to = job.decode_worker_id
        payload = None
        span.set_attribute("laneway.kv_bytes", len(data))
        try:
            if data:
                payload = await send_blob(
                    self._bus.publish_bytes, Subjects.kv_handoff(to), request_id, data
                )
            cached = output.cached_tokens or 0
            finish: FinishReason | None = "stop" if output.finish_reason == "stop" else None
            prompt_tokens = len(job.block_hashes) * self._block_size
            await self._publish(
                request_id,
                job,
                span,
                prefilled_tokens=max(0, prompt_tokens - cached),
                cached_tokens=cached,
                first_token_id=output.new_token_ids[-1],
                finish_reason=finish,
                block_hashes=job.block_hashes,
                payload=payload,
            )
            self._handoffs.labels("sent", "ok").inc()
        finally:
            span.end()

    async def failed(self, request_id: str, job: PrefillJob, message: str) -> None:
        """Tell the decode worker at once, so that it prefills locally without waiting."""
        self._handoffs.labels("sent", "failed").inc()
        await self._publish(request_id, job, job.span, prefilled_tokens=0, error=message)

    async def _publish(
        self, request_id: str, job: PrefillJob, span: Span, **fields: object
    ) -> None:
        """``span``: what the decode side's receiving links back to."""
        event = PrefillCompleted(
            event_id=f"prefilled-{request_id}",
            source=self._source,
            request_id=request_id,
            session_id=job.session_id,
            trace=trace_context(span),
            worker_id=self._worker_id,
            decode_worker_id=job.decode_worker_id,
            **fields,
        )
        await self._bus.publish(Subjects.prefilled(job.decode_worker_id, self._worker_id), event)


class KvReceiver:
    def __init__(
        self,
        block_size: int,
        transfer: KvTransferModel,
        speedup: float,
        timeout_s: float,
        timeout_factor: float,
    ) -> None:
        self.blobs = BlobAssembler()
        self._block_size = block_size
        self._transfer = transfer
        self._speedup = speedup
        self._timeout_s = timeout_s
        self._timeout_factor = timeout_factor

    def deadline_s(self, placement: PrefillPlacement) -> float:
        """How long to wait for a remote prefill before prefilling locally instead."""
        return self.within_s(placement.remote_ms or 0.0)

    def within_s(self, predicted_ms: float) -> float:
        """How long to wait for KV the planner predicted ``predicted_ms`` for (modelled time)."""
        return max(self._timeout_s, self._timeout_factor * self.wall_s(predicted_ms))

    def wall_s(self, modelled_ms: float) -> float:
        """The seconds of the clock that ``modelled_ms`` of modelled time take (the speed-up)."""
        return modelled_ms / 1000 / self._speedup

    async def receive(
        self, event: PrefillCompleted, cached_blocks: int, prompt_tokens: int
    ) -> bytes:
        """The hand-off's KV payload (empty for a modelled one, after the link's modelled time
        for the ``prompt_tokens`` beyond the ``cached_blocks`` this worker holds); ``ValueError``
        if it did not arrive whole and intact."""
        request_id = event.request_id or ""
        if event.payload is not None:
            return await self.blobs.take(request_id, event.payload, self._timeout_s)
        # Only the sim engine models its KV, and it hands the whole prompt over.
        tokens = handoff_tokens(prompt_tokens, cached_blocks, self._block_size)
        await asyncio.sleep(self.wall_s(self._transfer.transfer_ms(tokens)))
        return b""

    @staticmethod
    def transferred(
        event: PrefillCompleted, to: str, source: str, span: Span, started: float
    ) -> KvTransferred:
        return KvTransferred(
            source=source,
            request_id=event.request_id,
            session_id=event.session_id,
            trace=trace_context(span),
            from_worker_id=event.worker_id,
            to_worker_id=to,
            block_hashes=event.block_hashes,
            transfer_ms=(time.monotonic() - started) * 1000,
        )


class PrefillSide:
    """Prefills prompts for other workers: the first token is sampled here exactly as the
    aggregated path would sample it, then the prompt's KV goes to the decode worker."""

    def __init__(self, sender: KvSender, driver: EngineDriver, background: Background) -> None:
        self._sender = sender
        self._driver = driver
        self._background = background
        self._tracer = trace.get_tracer("laneway.worker")

    def start(
        self, event: RouteDecided, hashes: tuple[int, ...]
    ) -> tuple[PrefillJob, EngineRequest]:
        """The job and the engine request of ``event``'s prompt (``hashes`` at the engine's block
        size)."""
        assert event.request_id is not None
        span = self._tracer.start_span("worker.prefill", context=context_of(event))
        span.set_attribute("laneway.request_id", event.request_id)
        span.set_attribute("laneway.decode_worker_id", event.worker_id)
        job = PrefillJob(event.worker_id, hashes, span, event.session_id)
        one = event.spec.sampling.model_copy(update={"max_tokens": 1})
        root = salt_root(event.spec.cache_salt)
        spec = event.spec
        request = EngineRequest(
            event.request_id, spec.prompt_token_ids, one, hashes, root, spec.lora, spec.lora_path
        )
        return job, request

    async def done(self, request_id: str, job: PrefillJob, output: RequestOutput) -> None:
        """Runs between steps, so the prompt's blocks are still cached when they are exported."""
        portable = self._driver.portable
        assert portable is not None
        # The hand-off's own time (export, chunks, announcement), apart from the prefill's.
        send = self._tracer.start_span(
            "worker.kv_send", context=trace.set_span_in_context(job.span)
        )
        send.set_attribute("laneway.request_id", request_id)
        send.set_attribute("laneway.decode_worker_id", job.decode_worker_id)
        try:
            _, data = await self._driver.call(lambda: portable.export_prefix(job.block_hashes))
        except Exception as err:  # export is best effort: the decode worker then prefills
            log.exception("KV export of %s failed", request_id)
            send.set_attribute("laneway.failed", f"KV export failed: {err}")
            send.end()
            self.failed(request_id, job, f"KV export failed: {err}")
            return
        job.span.end()
        self._background.spawn(self._sender.hand_off(request_id, job, output, data, send))

    def failed(self, request_id: str, job: PrefillJob, message: str) -> None:
        self._driver.abort(request_id)
        job.span.set_attribute("laneway.failed", message)
        job.span.end()
        self._background.spawn(self._sender.failed(request_id, job, message))
