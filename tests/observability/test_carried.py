"""Where no span is recorded, the work an event causes carries the event's own trace context:
the same trace on every hop without a span made, parsed or written; ids are parsed only when a
link or a recording tracer asks."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from observability.carried import CarriedSpan, CarryingTracer
from observability.tracing import context_of, trace_context, trace_headers
from schemas.events import CancellationRequested, TraceContext

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = TraceContext(traceparent=f"00-{TRACE_ID}-b7ad6b7169203331-00", tracestate="lw=1")


def _caused() -> CancellationRequested:
    return CancellationRequested(
        source="ingress/i", request_id="r1", reason="client_disconnected", trace=PARENT
    )


def test_the_work_of_an_event_carries_its_context_unchanged() -> None:
    tracer = CarryingTracer()
    with tracer.start_as_current_span("planner.route", context=context_of(_caused())) as span:
        assert not span.is_recording()
        assert trace_context() is PARENT
        assert trace_headers() == {"traceparent": PARENT.traceparent, "tracestate": "lw=1"}
        # A child of it (a worker's kv move, its hand-off) is the same context again.
        child = tracer.start_span("worker.kv_move", context=trace.set_span_in_context(span))
        assert trace_context(child) is PARENT
    assert trace_context() is None and trace_headers() == {}


def test_work_without_a_cause_starts_an_unsampled_trace_of_its_own() -> None:
    tracer = CarryingTracer()
    with tracer.start_as_current_span("ingress.request") as first:
        carried = trace_context()
    second = tracer.start_span("ingress.request")
    assert carried is not None and trace_context(second) is not None
    _, trace_id, span_id, flags = carried.traceparent.split("-")
    assert int(trace_id, 16) and int(span_id, 16) and flags == "00"
    assert trace_context(second) != carried
    assert first.get_span_context().trace_id == int(trace_id, 16)


def test_its_ids_are_parsed_when_asked_and_a_recording_tracer_continues_it() -> None:
    span = trace.get_current_span(context_of(_caused()))
    assert isinstance(span, CarriedSpan)
    ids = span.get_span_context()
    assert (ids.trace_id, ids.span_id) == (int(TRACE_ID, 16), 0xB7AD6B7169203331)
    assert ids.trace_state.get("lw") == "1"
    sampled = _caused().model_copy(
        update={"trace": TraceContext(traceparent=PARENT.traceparent[:-2] + "01")}
    )
    recorded = TracerProvider().get_tracer("t").start_span("x", context=context_of(sampled))
    assert isinstance(recorded, ReadableSpan) and recorded.is_recording()
    assert recorded.get_span_context().trace_id == int(TRACE_ID, 16)
    assert recorded.parent is not None and recorded.parent.span_id == 0xB7AD6B7169203331


def test_an_event_without_a_trace_gives_work_a_trace_of_its_own() -> None:
    untraced = _caused().model_copy(update={"trace": None})
    with CarryingTracer().start_as_current_span("x", context=context_of(untraced)):
        carried = trace_context()
    assert carried is not None and TRACE_ID not in carried.traceparent
