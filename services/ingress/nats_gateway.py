"""The live Gateway: requests out as RequestAccepted, answers back from this instance's subjects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from nats.errors import MaxPayloadError
from opentelemetry import trace

from bus.client import Bus
from bus.topology import Subjects
from observability.tracing import trace_context
from schemas.codec import encode
from schemas.events import (
    CancellationRequested,
    RequestAccepted,
    RequestFailed,
    RequestSpec,
    TerminalEvent,
)
from services.ingress.gateway import CancelReason, GatewayEvent
from services.ingress.stream_order import StreamOrder


class NatsGateway:
    def __init__(self, bus: Bus, instance_id: str, completion_wait_s: float = 2.0) -> None:
        """``completion_wait_s``: how long a terminal event waits for the tokens it counts that
        have not arrived, before the request ends with an error instead."""
        self._bus = bus
        self._completion_wait_s = completion_wait_s
        self._instance_id = instance_id
        self._source = f"ingress/{instance_id}"
        self._streams: dict[str, asyncio.Queue[GatewayEvent]] = {}
        self._tracer = trace.get_tracer("laneway.ingress")

    async def start(self) -> None:
        # Core subscriptions on this instance's own subjects: set up once, lowest latency.
        await self._bus.subscribe(Subjects.tokens(self._instance_id), self._deliver)
        await self._bus.subscribe(Subjects.request_terminal(self._instance_id), self._deliver)

    async def _deliver(self, event: GatewayEvent) -> None:
        queue = self._streams.get(event.request_id or "")
        if queue is not None:
            queue.put_nowait(event)

    async def submit(
        self, request_id: str, session_id: str | None, spec: RequestSpec
    ) -> AsyncIterator[GatewayEvent]:
        queue: asyncio.Queue[GatewayEvent] = asyncio.Queue()
        self._streams[request_id] = queue
        with self._tracer.start_as_current_span("ingress.request") as span:
            span.set_attribute("laneway.request_id", request_id)
            span.set_attribute("laneway.prompt_tokens", len(spec.prompt_token_ids))
            try:
                accepted = RequestAccepted(
                    source=self._source,
                    request_id=request_id,
                    session_id=session_id,
                    trace=trace_context(span),
                    spec=spec,
                )
                try:
                    await self._bus.publish(Subjects.request_accepted, accepted)
                except MaxPayloadError:
                    # The engine could hold it, the bus cannot carry it: the client's to fix.
                    yield self._too_large(accepted)
                    return
                order = StreamOrder()
                while order.held is None:
                    for event in order.take(await queue.get()):
                        yield event
                        if isinstance(event, TerminalEvent):
                            span.set_attribute("laneway.outcome", event.type)
                            return
                # The terminal overtook tokens it counts: they are still on their way.
                for event in await self._complete(queue, order):
                    yield event
                span.set_attribute("laneway.outcome", event.type)
            finally:
                del self._streams[request_id]

    async def _complete(
        self, queue: asyncio.Queue[GatewayEvent], order: StreamOrder
    ) -> list[GatewayEvent]:
        """The rest of a request whose terminal is held: the missing tokens, then the terminal;
        or, if they do not come in time, the tokens that did, then the incomplete answer's end.
        The wait is bounded here, not around a yield, where it would cancel the caller's work."""
        ready: list[GatewayEvent] = []
        try:
            async with asyncio.timeout(self._completion_wait_s):
                while not ready or not isinstance(ready[-1], TerminalEvent):
                    ready.extend(order.take(await queue.get()))
        except TimeoutError:
            ready.append(order.give_up(self._source))
        return ready

    def _too_large(self, accepted: RequestAccepted) -> RequestFailed:
        limit = self._bus.nc.max_payload
        return RequestFailed(
            source=self._source,
            request_id=accepted.request_id,
            session_id=accepted.session_id,
            code="invalid_request",
            message=f"the request is {len(encode(accepted)):,} bytes as an event, more than the "
            f"message bus carries ({limit:,}): send a shorter prompt",
        )

    async def cancel(self, request_id: str, reason: CancelReason) -> None:
        await self._bus.publish(
            Subjects.cancellation_requested,
            CancellationRequested(source=self._source, request_id=request_id, reason=reason),
        )
