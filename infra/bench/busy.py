"""A worker's busy intervals, compact: an offline replay records one per engine step, millions.

Their total and their share of each window of the replay are sums whose order fixes their last
digits; numpy computes them here in the very order (and with the very operations) of a loop
over the intervals one by one, only without the loop.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np


class BusyIntervals:
    """(start, end) of every busy interval in order, seconds, kept as two arrays."""

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts = array("d")
        self._ends = array("d")

    def append(self, interval: tuple[float, float]) -> None:
        start, end = interval
        self._starts.append(start)
        self._ends.append(end)

    def chain(self, times: Sequence[float]) -> None:
        """Intervals back to back: from ``times[0]`` to ``times[1]``, then to ``times[2]``, …"""
        self._starts.extend(times[:-1])
        self._ends.extend(times[1:])

    def __len__(self) -> int:
        return len(self._starts)

    def last_end(self) -> float | None:
        return self._ends[-1] if self._ends else None

    def __getitem__(self, k: int) -> tuple[float, float]:
        return self._starts[k], self._ends[k]

    def __iter__(self) -> Iterator[tuple[float, float]]:
        return zip(self._starts, self._ends, strict=True)

    def total_s(self) -> float:
        """The sum of their lengths, added up first to last."""
        if not self._starts:
            return 0.0
        starts, ends = self._arrays()
        lengths = np.subtract(ends, starts)
        return float(np.add.accumulate(lengths)[-1])

    def timeline(self, width: float, bins: int) -> list[float]:
        """Their busy fraction of each of ``bins`` windows of ``width`` seconds (capped at 1):
        each interval adds its length in a window over ``width`` to it, first to last."""
        frac = np.zeros(bins)
        if not self._starts:
            return frac.tolist()
        starts, ends = self._arrays()
        window = np.floor_divide(starts, width).astype(np.int64)
        inside = (ends <= (window + 1) * width) & (window < bins) & (starts < ends)
        shares = (ends - starts) / width
        done = 0
        # Most intervals lie in one window; the few that cross (or lie past the last) are split
        # in order between runs of the others.
        for k in [*np.flatnonzero(~inside).tolist(), len(starts)]:
            np.add.at(frac, window[done:k], shares[done:k])
            if k < len(starts):
                start, end = float(starts[k]), float(ends[k])
                b = int(start // width)
                while start < end and b < bins:
                    edge = min(end, (b + 1) * width)
                    frac[b] += (edge - start) / width
                    start = edge
                    b += 1
            done = k + 1
        return [min(1.0, f) for f in frac.tolist()]

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        # Copies: a view would keep the arrays from growing while it lives.
        return np.array(self._starts, dtype=np.float64), np.array(self._ends, dtype=np.float64)
