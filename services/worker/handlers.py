"""A worker's inputs: routed requests (to serve, to prefill for another worker, or to decode after
a remote prefill), the prefill workers' hand-offs, and cancellations."""

from __future__ import annotations

import time

from opentelemetry import trace

from observability.tracing import context_of
from schemas.events import CancellationRequested, PrefillCompleted, RouteDecided
from services.common.tokenizer import Tokenizer
from services.worker.decode_side import DecodeSide
from services.worker.handoff import PrefillSide
from services.worker.kv_move import KvMoves
from services.worker.requests import Active, Requests
from services.worker.stream import RequestStream, request_detokenizer

# How long a cancellation for a request this worker has not (yet) seen is remembered: the
# cancel may overtake the route decision on its way here.
EARLY_CANCEL_MEMORY_S = 60.0


class Handlers:
    def __init__(
        self,
        worker_id: str,
        requests: Requests,
        prefill: PrefillSide,
        decode: DecodeSide,
        tokenizer: Tokenizer,
        moves: KvMoves | None = None,
    ) -> None:
        """``moves``: pulls a request's KV from another worker when the planner says so (None:
        such a request recomputes its prompt)."""
        self._worker_id = worker_id
        self._moves = moves
        self._requests = requests
        self._prefill = prefill
        self._decode = decode
        self._tokenizer = tokenizer
        self._early_cancels: dict[str, float] = {}
        # Stopping: a route that still comes moves on to another worker at once.
        self.draining = False
        self._tracer = trace.get_tracer("laneway.worker")

    async def on_prefilled(self, event: PrefillCompleted) -> None:
        self._decode.on_prefilled(event)

    async def on_route(self, event: RouteDecided) -> None:
        if event.request_id is None:
            return
        request_id = event.request_id
        held = self._requests.active.get(request_id)
        if held is not None and held.spec.attempt < event.spec.attempt:
            # It moved away from here (this worker stalled) and back: the new attempt replaces it.
            self._requests.abort(request_id)
            self._requests.forget(request_id)
        elif self._requests.holds(request_id):  # a redelivery
            return
        elif self._requests.ran(request_id, event.spec.attempt):
            # A redelivery after it ended (its ack was lost): run again, it would publish the
            # attempt's tokens anew, chunked otherwise than what its stream already has.
            return
        remote = event.prefill.prefill_worker_id if event.prefill is not None else None
        if remote == self._worker_id and event.worker_id != self._worker_id:
            await self._start_prefill(event)
            return
        span = self._tracer.start_span("worker.generate", context=context_of(event))
        span.set_attribute("laneway.request_id", request_id)
        span.set_attribute("laneway.worker_id", self._worker_id)
        spec = event.spec
        offset = spec.sampling.offset
        stream = RequestStream(
            len(spec.prompt_token_ids) - offset,
            time.monotonic(),
            request_detokenizer(self._tokenizer, spec),
            offset=offset,
        )
        state = Active(spec, event.session_id, span, stream)
        self._requests.hold(request_id, state)
        if self._early_cancels.pop(request_id, None) is not None:
            await self._requests.cancelled(request_id, "client_disconnected")
            return
        if self.draining:
            await self._requests.fail(request_id, "the worker is draining", "worker_lost")
            return
        if remote is not None and event.prefill is not None:
            self._decode.await_prefill(request_id, state, event)
            return
        if event.kv_move is not None and self._moves is not None:
            self._moves.pull(request_id, state, event)
            return
        await self._requests.admit(self._requests.engine_request(request_id, spec))

    async def _start_prefill(self, event: RouteDecided) -> None:
        assert event.request_id is not None
        request_id = event.request_id
        if self._early_cancels.pop(request_id, None) is not None:
            return
        job, request = self._prefill.start(event, self._requests.block_hashes(event.spec))
        self._requests.prefills[request_id] = job
        await self._requests.admit(request)

    async def on_cancel(self, event: CancellationRequested) -> None:
        if event.request_id is None:
            return
        if self._requests.prefill_cancelled(event.request_id):
            return  # the decode worker holds the request and ends it
        if event.request_id in self._requests.active:
            self._requests.abort(event.request_id)
            await self._requests.cancelled(event.request_id, event.reason)
            return
        now = time.monotonic()
        self._early_cancels[event.request_id] = now
        for request_id, at in list(self._early_cancels.items()):
            if now - at > EARLY_CANCEL_MEMORY_S:
                del self._early_cancels[request_id]
