"""Tracing where nothing is recorded: a request's trace context carried from event to event as
it came, with no span made, parsed or written on the way.

With no exporter, OpenTelemetry's SDK still made every span (ids drawn, the sampler asked, the
context parsed from each event and written into each event it caused) only to record none of
it: about 8 % of a live request's CPU over all services (c=32, 4 sim workers, the same tree with
tracing off altogether, 3 alternating rounds). Here the work an event causes takes the event's
own context as its span, and the events it publishes carry that context unchanged: the same
trace id on every hop, as before, which is all an unrecorded trace is read for (``laneway
explain``). A request's first hop, which has no cause, starts a trace of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from schemas.envelope import TraceContext

PROPAGATOR = TraceContextTextMapPropagator()


class CarriedSpan(NonRecordingSpan):
    """A span not recorded, standing for the one that caused the work: what it causes carries
    ``carried``. Its ids are parsed only when asked for (a link, a recording child)."""

    def __init__(self, carried: TraceContext) -> None:
        super().__init__(INVALID_SPAN_CONTEXT)
        self.carried = carried
        self._parsed: SpanContext | None = None

    def headers(self) -> dict[str, str]:
        """The carried context as W3C ``traceparent``/``tracestate`` headers."""
        carried = self.carried
        if carried.tracestate:
            return {"traceparent": carried.traceparent, "tracestate": carried.tracestate}
        return {"traceparent": carried.traceparent}

    def get_span_context(self) -> SpanContext:
        if self._parsed is None:
            parent = PROPAGATOR.extract(self.headers(), context=otel_context.Context())
            self._parsed = trace.get_current_span(parent).get_span_context()
        return self._parsed


def carried_context(carried: TraceContext | None) -> otel_context.Context:
    """An OpenTelemetry context whose span is the one ``carried`` names (none: empty)."""
    if carried is None:
        return otel_context.Context()
    return trace.set_span_in_context(CarriedSpan(carried), otel_context.Context())


def new_trace() -> TraceContext:
    """A trace of its own, unsampled (its W3C flags 00: a recording process downstream records
    nothing of it either)."""
    return TraceContext(traceparent=f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-00")


class CarryingTracer(trace.Tracer):
    """Spans are the causes' own (:class:`CarriedSpan`); a span without a cause starts a trace."""

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Any = None,
        links: Sequence[trace.Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        parent = trace.get_current_span(context)
        return parent if isinstance(parent, CarriedSpan) else CarriedSpan(new_trace())

    def start_as_current_span(  # type: ignore[override]
        self, name: str, context: otel_context.Context | None = None, *_: Any, **__: Any
    ) -> AbstractContextManager[trace.Span]:
        """As :meth:`start_span`, current while the block runs; the API's other arguments are
        taken and ignored, as nothing is recorded. A plain context manager, not the API's
        generator-based one: a third of the cost."""
        return _Current(self.start_span(name, context))


class _Current(AbstractContextManager[trace.Span]):
    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, *exc_info: object) -> None:
        otel_context.detach(self._token)


class CarryingTracerProvider(trace.TracerProvider):
    def __init__(self) -> None:
        self._tracer = CarryingTracer()

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return self._tracer
