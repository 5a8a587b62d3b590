"""The capacity loop: move workers between the prefill and decode pools when TTFT or ITL drift
from their targets (the seed article's advice): a small step at a time, then a cool-down to see
its effect, with hysteresis so that it does not flap, reacting to queue growth as well as to
latencies (a burst shows in the prefill queue before it shows in finished requests).

Pure: the live planner and the offline simulator call it with what they observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Move = Literal["to_prefill", "to_decode"]


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    ttft_target_ms: float = 1000.0
    itl_target_ms: float = 25.0
    # Seconds between decisions; each decision looks at the requests of the last interval.
    interval_s: float = 60.0
    # Intervals to wait after a move before the next one, to see what it did. A move that undoes
    # the previous one doubles the wait (up to `max_cooldown_intervals`): the split between two
    # that each miss a different target is held longer instead of flapping; a move onward resets.
    cooldown_intervals: int = 1
    max_cooldown_intervals: int = 8
    # Share of the pool one step may move (at least one worker).
    max_move_fraction: float = 0.1
    # A latency must be this far past its target (as a fraction) to act on it.
    hysteresis: float = 0.1
    # Prefill queue growth over one interval (tokens per prefill worker) that counts as a TTFT
    # violation by itself.
    burst_tokens_per_worker: int = 200_000


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def p95_or_none(values: Sequence[float]) -> float | None:
    """An interval's p95, None when nothing finished in it."""
    return percentile(values, 95) if values else None


@dataclass(frozen=True, slots=True)
class Observation:
    """What one interval showed. Latencies are p95 over requests of the interval, or None."""

    ttft_p95_ms: float | None
    itl_p95_ms: float | None
    prefill_queue_tokens: int
    prefill_workers: int
    decode_workers: int


@dataclass(frozen=True, slots=True)
class Decision:
    move: Move | None
    workers: int
    reason: str


class CapacityPlanner:
    def __init__(self, settings: CapacitySettings | None = None) -> None:
        self.settings = settings or CapacitySettings()
        self._cooldown = 0
        self._wait = self.settings.cooldown_intervals
        self._last_move: Move | None = None
        self._last_queue: int | None = None

    def decide(self, obs: Observation) -> Decision:
        s = self.settings
        growth = obs.prefill_queue_tokens - (self._last_queue or 0)
        self._last_queue = obs.prefill_queue_tokens
        if self._cooldown > 0:
            self._cooldown -= 1
            return Decision(None, 0, "cooling down after the last move")
        ttft = (obs.ttft_p95_ms or 0.0) / s.ttft_target_ms
        itl = (obs.itl_p95_ms or 0.0) / s.itl_target_ms
        burst = growth > s.burst_tokens_per_worker * max(1, obs.prefill_workers)
        if burst:
            ttft = max(ttft, 1.0 + 2 * s.hysteresis)
        pool = obs.prefill_workers + obs.decode_workers
        step = max(1, int(pool * s.max_move_fraction))
        over = 1.0 + s.hysteresis
        if ttft > over and ttft >= itl and obs.decode_workers > step:
            why = "prefill queue burst" if burst else f"TTFT p95 at {ttft:.2f}× target"
            return self._move("to_prefill", step, why)
        # Never below one prefill worker: without a prefill pool, slow tokens come from prefills
        # interleaved with the decodes, which fewer prefill workers would only make worse.
        if itl > over and itl > ttft and obs.prefill_workers > step:
            return self._move("to_decode", step, f"ITL p95 at {itl:.2f}× target")
        return Decision(None, 0, f"within targets (TTFT {ttft:.2f}×, ITL {itl:.2f}×)")

    def _move(self, move: Move, step: int, why: str) -> Decision:
        s = self.settings
        if self._last_move is not None and move != self._last_move:
            self._wait = min(s.max_cooldown_intervals, 2 * self._wait)
            why += f"; undoes the last move, next wait {self._wait} intervals"
        else:
            self._wait = s.cooldown_intervals
        self._last_move = move
        self._cooldown = self._wait
        return Decision(move, step, why)
