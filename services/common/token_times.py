"""When a request's tokens came: the first, the latest, and the gap each later output closed.

Inter-token latency as vLLM's benchmark and Dynamo's replay count it: every gap between two
outputs of a request, in order. One bookkeeping of it, kept alike by a worker's streams, an
offline replay's records and a live replay's client (whose outputs are chunks).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import mul, sub


@dataclass(slots=True)
class TokenTimes:
    """Times in seconds on the keeper's clock; gaps in milliseconds."""

    first_s: float | None = None
    last_s: float | None = None
    gaps_ms: array[float] = field(default_factory=lambda: array("d"))
    # Where each gap goes instead of ``gaps_ms`` (a histogram's ``add``): a long answer's gaps
    # then hold no memory.
    sink: Callable[[float], None] | None = None

    def came(self, now: float) -> float | None:
        """Tokens came at ``now`` (a step's, or a chunk's): the gap they closed, None for the
        first."""
        last = self.last_s
        self.last_s = now
        if last is None:
            self.first_s = now
            return None
        gap = (now - last) * 1000
        if self.sink is None:
            self.gaps_ms.append(gap)
        else:
            self.sink(gap)
        return gap

    def came_in_steps(self, first: float, later_gaps_ms: array[float], last: float) -> None:
        """After the first token, a run of steps' tokens came: a step's at ``first``, then one a
        gap of ``later_gaps_ms`` later each, the last at ``last``. Each closes a gap of its own,
        as stepped one by one (the later gaps are a decode run's, alike for its whole batch)."""
        assert self.last_s is not None, "a run of steps follows the first token"
        gap = (first - self.last_s) * 1000
        self.last_s = last
        sink = self.sink
        if sink is None:
            self.gaps_ms.append(gap)
            self.gaps_ms.extend(later_gaps_ms)
            return
        sink(gap)
        for later in later_gaps_ms:
            sink(later)


def gaps_ms(times: Sequence[float]) -> array[float]:
    """The gaps between consecutive ``times`` (seconds), in milliseconds."""
    return array("d", map(mul, map(sub, times[1:], times[:-1]), repeat(1000)))
