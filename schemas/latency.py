"""A latency histogram small enough to ride on an event and cheap to merge: log-spaced buckets,
32 per doubling, so a percentile read from it is within about 1.1% of the exact one.

Inter-token latency is a percentile over every gap between consecutive tokens of every request
(as vLLM's benchmark and Dynamo's replay count it), and a request's gaps are too many to send one
by one; their bucket counts are not.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

_PER_DOUBLING = 32
# Gaps below this land in bucket 0: no engine step is that short.
_FLOOR_MS = 0.1


def _bucket(ms: float) -> int:
    return max(0, math.floor(_PER_DOUBLING * math.log2(max(ms, _FLOOR_MS) / _FLOOR_MS)))


def _midpoint_ms(bucket: int) -> float:
    return float(_FLOOR_MS * 2 ** ((bucket + 0.5) / _PER_DOUBLING))


class LatencyHistogram(BaseModel):
    counts: dict[int, int] = Field(default_factory=dict, description="bucket index -> samples")

    def add(self, ms: float) -> None:
        b = _bucket(ms)
        self.counts[b] = self.counts.get(b, 0) + 1

    def merge(self, other: LatencyHistogram) -> None:
        for b, n in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + n

    def total(self) -> int:
        return sum(self.counts.values())

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (nearest rank), as its bucket's geometric midpoint; None when
        empty."""
        total = self.total()
        if total == 0:
            return None
        rank = max(1, math.ceil(total * q / 100.0))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                break
        return _midpoint_ms(b)
