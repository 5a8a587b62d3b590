"""Tracing: one trace per request across processes, carried in each event's envelope.

The exporter is a setting: ``none``, ``console``, ``otlp`` (HTTP, endpoint from the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``) or ``file:PATH`` (JSON lines, for tests and offline inspection).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span

from observability.carried import (
    PROPAGATOR,
    CarriedSpan,
    CarryingTracerProvider,
    carried_context,
)
from schemas.events import Envelope, TraceContext


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span; several processes may share the file."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "instance": span.resource.attributes.get("service.instance.id"),
                        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
                        "span_id": f"{ctx.span_id:016x}" if ctx else None,
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "start_ns": span.start_time,
                        "end_ns": span.end_time,
                        "attributes": dict(span.attributes or {}),
                        "links": [f"{link.context.span_id:016x}" for link in span.links],
                    }
                )
            )
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS


def _exporter(spec: str) -> SpanExporter | None:
    if spec in ("", "none"):
        return None
    if spec == "console":
        return ConsoleSpanExporter()
    if spec == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if spec.startswith("file:"):
        return JsonLinesSpanExporter(Path(spec.removeprefix("file:")))
    raise ValueError(f"unknown trace exporter {spec!r}: use none, console, otlp or file:PATH")


def setup_tracing(service: str, instance: str, exporter: str) -> trace.TracerProvider:
    """With no exporter nothing could read a span, so none is made: a request's trace context
    goes from event to event as it came (:mod:`observability.carried`), so its events still
    name its trace, which ``laneway explain`` shows. A process that exports samples by
    OpenTelemetry's settings (``OTEL_TRACES_SAMPLER``; by default every trace whose parent was
    sampled), so every service of a cluster is given the same exporter (``laneway up`` and the
    manifests do)."""
    span_exporter = _exporter(exporter)
    if span_exporter is None:
        carrying = CarryingTracerProvider()
        trace.set_tracer_provider(carrying)
        return carrying
    provider = TracerProvider(
        resource=Resource.create({"service.name": service, "service.instance.id": instance})
    )
    # Files are read by tests right after a request: write them at span end.
    processor = (
        SimpleSpanProcessor(span_exporter)
        if isinstance(span_exporter, JsonLinesSpanExporter)
        else BatchSpanProcessor(span_exporter)
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def trace_context(span: Span | None = None) -> TraceContext | None:
    """The context of ``span`` (default: the active span), for the envelope of events it causes."""
    current = span if span is not None else trace.get_current_span()
    if isinstance(current, CarriedSpan):
        return current.carried
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(current))
    if "traceparent" not in carrier:
        return None
    return TraceContext(traceparent=carrier["traceparent"], tracestate=carrier.get("tracestate"))


def context_of(event: Envelope) -> otel_context.Context:
    """The trace context that caused ``event``: new spans for its work continue that trace."""
    return carried_context(event.trace)


def trace_headers() -> dict[str, str]:
    """The active span's context as W3C ``traceparent``/``tracestate`` headers (empty outside a
    span): a query is no event and has no envelope, so its trace rides in the NATS headers."""
    current = trace.get_current_span()
    if isinstance(current, CarriedSpan):
        return current.headers()
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return carrier


def context_of_headers(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context that message ``headers`` carry (an empty one if none): never the
    receiver's own, so unrelated work is not parented to whatever span happens to be active."""
    return PROPAGATOR.extract(dict(headers or {}), context=otel_context.Context())
