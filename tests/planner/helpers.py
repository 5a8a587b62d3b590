"""Helpers of the planner's overlap tests: a stand-in kv-indexer, and the planner's asker."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram

from bus.client import Bus
from bus.topology import Subjects
from schemas.messages import OverlapQueries, OverlapReplies
from services.planner.overlaps import OverlapAsker


async def indexer(
    bus: Bus, answer: Callable[[OverlapQueries], OverlapReplies]
) -> list[OverlapQueries]:
    """A stand-in kv-indexer on the batch endpoint; the batches it was asked."""
    asked: list[OverlapQueries] = []

    async def on_queries(batch: OverlapQueries) -> OverlapReplies:
        asked.append(batch)
        return answer(batch)

    await bus.serve(Subjects.overlap_queries, on_queries, queue="test")
    return asked


def asker(bus: Bus, timeout_s: float = 2.0) -> tuple[OverlapAsker, Callable[[], float | None]]:
    """The asker, and how many queries it counted failed so far."""
    registry = CollectorRegistry()
    failures = Counter("failures", "", registry=registry)
    seconds = Histogram("seconds", "", registry=registry)
    return OverlapAsker(bus, timeout_s, seconds, failures), lambda: registry.get_sample_value(
        "failures_total"
    )
