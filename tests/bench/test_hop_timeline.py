"""A sequential request's messages, each labelled by kind and number within its request, at the
median of their times after the request was sent."""

from __future__ import annotations

import pytest

from benchmarks.hop_timeline import CLIENT_END, CLIENT_FIRST, render, timeline
from infra.bench.load_client import Sample


def _sample(sent: float, first: float, end: float) -> Sample:
    return Sample(sent=sent, chunk_times=[first], end=end)


def test_messages_are_labelled_within_their_request_and_ordered_by_median() -> None:
    samples = [_sample(10.0, 10.004, 10.005), _sample(20.0, 20.006, 20.008)]
    seen = [
        (10.001, "lw.req.accepted"),
        (10.002, "lw.tok.*.*"),
        (10.003, "lw.tok.*.*"),
        (10.020, "lw.load.*"),  # after the client's end, before the next request: its own
        (20.003, "lw.req.accepted"),
        (20.004, "lw.tok.*.*"),
        (20.005, "lw.tok.*.*"),
        (9.5, "lw.load.*"),  # before the first request: nobody's
    ]
    rows = timeline(seen, samples)
    by_label = {row.label: row for row in rows}
    assert by_label["lw.req.accepted#1"].median_ms == pytest.approx(2.0)
    assert by_label["lw.tok.*.*#1"].median_ms == pytest.approx(3.0)
    assert by_label["lw.tok.*.*#2"].median_ms == pytest.approx(4.0)
    assert by_label[CLIENT_FIRST].median_ms == pytest.approx(5.0)
    assert by_label[CLIENT_END].median_ms == pytest.approx(6.5)
    load = by_label["lw.load.*#1"]
    assert (load.median_ms, load.requests) == (pytest.approx(20.0), 1)
    assert [row.label for row in rows] == [
        "lw.req.accepted#1",
        "lw.tok.*.*#1",
        "lw.tok.*.*#2",
        CLIENT_FIRST,
        CLIENT_END,
        "lw.load.*#1",
    ]
    assert render(rows, 2).splitlines()[-1].split() == ["20.00", "1/2", "lw.load.*#1"]


def test_failed_requests_are_left_out() -> None:
    failed = Sample(sent=1.0, end=1.5, error="HTTP 503: busy")
    rows = timeline([(1.1, "lw.req.accepted")], [failed])
    assert rows == []
