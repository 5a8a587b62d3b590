"""The decode worker's side of a hand-off: it waits for the prefill worker's first token and KV
(not forever), then continues the request from the first token; whatever goes wrong costs a local
prefill, never the request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from opentelemetry import trace
from opentelemetry.trace import Link, Span
from prometheus_client import Counter

from observability.drops import Drops
from observability.tracing import context_of
from schemas.events import PrefillCompleted, RouteDecided
from services.engine.continuation import continuation
from services.worker.parts import WorkerParts, WorkerSide
from services.worker.requests import Active, Awaiting

log = logging.getLogger(__name__)
drops = Drops(log)

# A remote prefill's answer travels apart from the decode worker's route (a core subscription,
# beside the route's durable), so it may come first: kept for its route this long, this many.
EARLY_PREFILLED_S = 30.0
EARLY_PREFILLED_KEPT = 1024


class DecodeSide(WorkerSide):
    def __init__(self, parts: WorkerParts, handoffs: Counter) -> None:
        """``handoffs``: counts the hand-offs received, by side and outcome."""
        super().__init__(parts)
        self._handoffs = handoffs
        self._early: OrderedDict[str, tuple[float, PrefillCompleted]] = OrderedDict()

    def _child(self, name: str, state: Active, links: list[Link] | None = None) -> Span:
        return self._tracer.start_span(
            name, context=trace.set_span_in_context(state.span), links=links
        )

    def await_prefill(self, request_id: str, state: Active, event: RouteDecided) -> None:
        placement = event.prefill
        assert placement is not None and placement.prefill_worker_id is not None
        me = self._outputs.worker_id
        cached = next((c.cached_blocks for c in event.candidates if c.worker_id == me), 0)
        timeout = self._receiver.deadline_s(placement)
        wait = self._child("worker.kv_wait", state)
        wait.set_attribute("laneway.prefill_worker_id", placement.prefill_worker_id)
        wait.set_attribute("laneway.timeout_s", timeout)
        state.awaiting = Awaiting(placement.prefill_worker_id, cached, wait)
        state.awaiting.timer = self._background.spawn(self._deadline(request_id, timeout))
        early = self._early.pop(request_id, None)
        if early is not None:
            self.on_prefilled(early[1])

    def on_prefilled(self, event: PrefillCompleted) -> None:
        """``event`` came on this worker's subject from ``event.worker_id`` (the bus checked
        the subject); it is taken only from the prefill worker the request's route named."""
        request_id = event.request_id or ""
        state = self._requests.active.get(request_id)
        if state is None:
            self._keep_early(event)
            return
        awaiting = state.awaiting
        if awaiting is None:
            self._receiver.blobs.drop(request_id)  # fell back or cancelled
            return
        if event.worker_id != awaiting.prefill_worker_id:
            drops(
                "not_placed_worker",
                "dropping a PrefillCompleted for %s from %s: its route named %s",
                request_id,
                event.worker_id,
                awaiting.prefill_worker_id,
            )
            return
        if awaiting.receiving:
            return  # a second word of the hand-off under way: its chunks are still coming
        if event.error is not None or event.first_token_id is None:
            self._fall_back(request_id, state, f"remote prefill failed: {event.error}")
            return
        awaiting.settle("prefilled")
        awaiting.receiving = True
        if awaiting.timer is not None:
            awaiting.timer.cancel()
        self._background.spawn(self._receive(request_id, state, event))

    async def _receive(self, request_id: str, state: Active, event: PrefillCompleted) -> None:
        started = time.monotonic()
        cached = state.awaiting.cached_blocks if state.awaiting is not None else 0
        # Receiving and importing, in this request's trace, linked to the sender's span.
        sender = trace.get_current_span(context_of(event)).get_span_context()
        span = self._child("worker.kv_receive", state, [Link(sender)] if sender.is_valid else None)
        span.set_attribute("laneway.prefill_worker_id", event.worker_id)
        try:
            data = await self._receiver.receive(event, cached, len(state.spec.prompt_token_ids))
        except ValueError as err:
            span.set_attribute("laneway.failed", str(err))
            span.end()
            if self._requests.active.get(request_id) is state:
                self._fall_back(request_id, state, f"KV hand-off failed: {err}")
            return
        span.set_attribute("laneway.kv_bytes", len(data))
        if self._requests.active.get(request_id) is not state:  # cancelled meanwhile
            span.set_attribute("laneway.cancelled", True)
            span.end()
            return
        state.awaiting = None
        state.prefilled_by = event.worker_id
        self._handoffs.labels("received", "ok").inc()
        self._outputs.kv_transferred(
            self._receiver.transferred(
                event, self._outputs.worker_id, self._outputs.source, span, started
            )
        )
        assert event.first_token_id is not None
        resumed = continuation(
            self._requests.engine_request(request_id, state.spec),
            event.first_token_id,
            self._driver.engine.block_size,
            event.finish_reason,
            event.cached_tokens,
        )
        await self._requests.output(resumed.first)
        if resumed.rest is None or request_id not in self._requests.active:
            span.end()
            return  # the first token was the last
        portable = self._driver.portable
        hashes = event.block_hashes

        def adopt() -> bool:
            # An engine op: the receive span ends once the KV is in the engine (or refused).
            try:
                if portable is not None:
                    portable.import_prefix(hashes, data)
            except Exception as err:  # unusable KV costs a local prefill, never the request
                log.exception("KV import of %s failed; prefilling locally", request_id)
                span.set_attribute("laneway.failed", f"KV import failed: {err}")
                return False
            finally:
                span.end()
            return portable is not None

        await self._requests.admit(resumed.rest, adopt, resumed.handed_off_tokens)

    def _keep_early(self, event: PrefillCompleted) -> None:
        """Its route may not be here yet; an answer whose route never comes (it ended, or it
        was forged) is forgotten after a while."""
        now = time.monotonic()
        request_id = event.request_id or ""
        self._early.pop(request_id, None)
        self._early[request_id] = (now, event)
        while self._early:
            at, _ = next(iter(self._early.values()))
            if now - at <= EARLY_PREFILLED_S and len(self._early) <= EARLY_PREFILLED_KEPT:
                break
            self._early.popitem(last=False)

    async def _deadline(self, request_id: str, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        state = self._requests.active.get(request_id)
        if state is not None and state.awaiting is not None and not state.awaiting.receiving:
            state.awaiting.timer = None
            self._fall_back(request_id, state, f"no KV hand-off within {timeout_s:.1f} s")

    def _fall_back(self, request_id: str, state: Active, why: str) -> None:
        log.warning("request %s: %s; prefilling locally", request_id, why)
        self._handoffs.labels("received", "failed").inc()
        state.span.set_attribute("laneway.handoff_fallback", why)
        if state.awaiting is not None:
            state.awaiting.settle(why)
            if state.awaiting.timer is not None:
                state.awaiting.timer.cancel()
        state.awaiting = None
        self._receiver.blobs.drop(request_id)
        self._background.spawn(
            self._requests.admit(self._requests.engine_request(request_id, state.spec))
        )
