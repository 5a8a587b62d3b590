"""A process without a trace exporter records no spans, yet its events still name their trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace

from observability.tracing import setup_tracing, trace_context


@pytest.fixture(autouse=True)
def _no_global_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process-wide provider is set once per process: other tests keep theirs.
    monkeypatch.setattr(trace, "set_tracer_provider", lambda provider: None)


def test_no_exporter_spans_are_unrecorded_but_carry_a_trace() -> None:
    tracer = setup_tracing("laneway-test", "i", "none").get_tracer("t")
    with tracer.start_as_current_span("root") as span:
        assert not span.is_recording()
        carried = trace_context()
    assert carried is not None
    _, trace_id, _, flags = carried.traceparent.split("-")
    assert int(trace_id, 16) == span.get_span_context().trace_id != 0
    assert not int(flags, 16) & 1  # unsampled: the next hops record nothing of it either


def test_with_an_exporter_spans_are_recorded(tmp_path: Path) -> None:
    tracer = setup_tracing("laneway-test", "i", f"file:{tmp_path / 's.jsonl'}").get_tracer("t")
    with tracer.start_as_current_span("root") as span:
        assert span.is_recording()
        carried = trace_context()
    assert carried is not None and int(carried.traceparent.rsplit("-", 1)[1], 16) & 1
    assert '"name": "root"' in (tmp_path / "s.jsonl").read_text()
