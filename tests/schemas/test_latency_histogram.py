"""The token-gap histogram events carry: percentiles within a bucket's width of the exact ones,
merging, and the wire form."""

from __future__ import annotations

import random

import pytest

from schemas.events import RequestFinished, Usage
from schemas.latency import LatencyHistogram
from services.planner.capacity import percentile


def test_percentiles_are_within_a_bucket_of_the_exact_ones() -> None:
    rng = random.Random(7)
    # Mostly fast steps, a tail of steps slowed by prefill chunks: the shape ITL has.
    gaps = [rng.uniform(5, 12) for _ in range(930)] + [rng.uniform(150, 190) for _ in range(70)]
    hist = LatencyHistogram()
    for gap in gaps:
        hist.add(gap)
    assert hist.total() == 1000
    for q in (50, 90, 95, 99):
        exact = percentile(gaps, q)
        assert hist.percentile(q) == pytest.approx(exact, rel=0.1), q
    assert hist.percentile(50) < 13 < hist.percentile(99)  # type: ignore[operator]


def test_merge_pools_samples_of_many_requests() -> None:
    fast, slow = LatencyHistogram(), LatencyHistogram()
    for _ in range(90):
        fast.add(10.0)
    for _ in range(10):
        slow.add(200.0)
    pooled = LatencyHistogram()
    pooled.merge(fast)
    pooled.merge(slow)
    # Every gap counts once: the slow request's ten gaps are 10% of the pool, not half of it.
    assert pooled.total() == 100
    assert pooled.percentile(90) == pytest.approx(10.0, rel=0.05)
    assert pooled.percentile(95) == pytest.approx(200.0, rel=0.05)
    assert fast.total() == 90  # merging leaves its inputs alone


def test_empty_and_tiny_gaps() -> None:
    hist = LatencyHistogram()
    assert hist.percentile(95) is None
    hist.add(0.0)
    assert hist.percentile(95) == pytest.approx(0.1, rel=0.05)


def test_it_travels_on_request_finished() -> None:
    hist = LatencyHistogram()
    for gap in (8.0, 9.0, 120.0):
        hist.add(gap)
    event = RequestFinished(
        source="t",
        request_id="r",
        worker_id="w",
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=4),
        ttft_ms=50.0,
        e2e_ms=187.0,
        token_gaps=hist,
    )
    back = RequestFinished.model_validate_json(event.model_dump_json())
    assert back.token_gaps == hist and back.token_gaps.percentile(100) == hist.percentile(100)
