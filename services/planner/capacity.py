"""The capacity loop: move workers between the prefill and decode pools when TTFT or ITL drift
from their targets (the seed article's advice): a small step at a time, each judged at the next
look, with hysteresis so that it does not flap, reacting to queue growth as well as to
latencies (a burst shows in the prefill queue before it shows in finished requests).

Pure: the live planner and the offline simulator call it with what they observed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from schemas.latency import LatencyHistogram
from services.planner.policy import WorkerView

Move = Literal["to_prefill", "to_decode"]
Target = Literal["ttft", "itl"]


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    ttft_target_ms: float = 1000.0
    itl_target_ms: float = 25.0
    # Seconds between decisions; each decision looks at the requests of the last interval.
    interval_s: float = 60.0
    # Looks to sit out after a move onward; 0 by default: the next look judges the move (it is
    # on probation) and may take the next step, so a start far from the right split gets there
    # a step an interval instead of one every other (docs/routing.md, "Measured from every
    # start"). A move that undoes the previous one waits at least one interval, twice the
    # previous wait when that followed an undo too (up to `max_cooldown_intervals`): the split
    # between two that each miss a different target is held longer instead of flapping.
    cooldown_intervals: int = 0
    max_cooldown_intervals: int = 8
    # Share of the pool one step may move (at least one worker).
    max_move_fraction: float = 0.1
    # A target is a ceiling: a latency past it is acted on, however little. A prefill worker
    # goes back only while both latencies are this much (as a fraction) under their targets, so
    # that the step back does not lose one at once; between the two, the pools are held.
    hysteresis: float = 0.1
    # Prefill queue growth over one interval (tokens per prefill worker) that counts as a TTFT
    # violation by itself.
    burst_tokens_per_worker: int = 200_000
    # A move made for a latency at most `probation_max_ratio` times its target is undone when,
    # by the time the loop looks again, that latency grew by more than `hysteresis` (the load
    # drifts between two looks: a move that helped can still see its latency rise a little). It
    # is then not tried again from the same split for `futile_intervals`, twice that after a
    # second failure, and so on (up to `max_futile_intervals`). Further past the target the
    # pools are overloaded, queues take longer than an interval to drain, and the move is judged
    # by its direction alone.
    probation_max_ratio: float = 2.0
    futile_intervals: int = 10
    max_futile_intervals: int = 80


def workers_to_move(pool: Sequence[WorkerView], count: int) -> list[str]:
    """The ``count`` workers a move takes from ``pool``: the least loaded, since they finish
    their in-flight work soonest."""
    return [w.worker_id for w in sorted(pool, key=lambda w: (w.load, w.worker_id))[:count]]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    return percentile_of_sorted(sorted(values), q)


def percentile_of_sorted(ordered: Sequence[float], q: float) -> float:
    """:func:`percentile` of values sorted already (a bench sorts millions of gaps in numpy)."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def p95_or_none(values: Sequence[float]) -> float | None:
    """An interval's p95, None when nothing finished in it."""
    return percentile(values, 95) if values else None


@dataclass(frozen=True, slots=True)
class Observation:
    """What one interval showed. Latencies are p95 over the interval's requests (ITL over all
    their token gaps), or None when there were none."""

    ttft_p95_ms: float | None
    itl_p95_ms: float | None
    prefill_queue_tokens: int
    prefill_workers: int
    decode_workers: int
    # TTFT p95 of the requests prefilled on a prefill worker, and of those prefilled where they
    # decode: which pool the slow first tokens come from.
    remote_ttft_p95_ms: float | None = None
    local_ttft_p95_ms: float | None = None
    # Share of the token gaps whose step also computed prompt tokens (prefill interference).
    stalled_gap_share: float = 0.0


def observe_interval(
    first_tokens: Sequence[tuple[float, bool]],
    gaps: LatencyHistogram,
    stalled_gaps: int,
    prefill_queue_tokens: int,
    prefill_workers: int,
    decode_workers: int,
) -> Observation:
    """An interval's observation from its requests' (TTFT ms, prefilled remotely) and their
    token gaps, of which ``stalled_gaps`` waited on a prefill."""
    ttft = [t for t, _ in first_tokens]
    return Observation(
        p95_or_none(ttft),
        gaps.percentile(95),
        prefill_queue_tokens,
        prefill_workers,
        decode_workers,
        p95_or_none([t for t, remote in first_tokens if remote]),
        p95_or_none([t for t, remote in first_tokens if not remote]),
        stalled_gaps / max(1, gaps.total()),
    )


@dataclass(frozen=True, slots=True)
class Decision:
    move: Move | None
    workers: int
    reason: str
    # The targets missed that no move between the pools can meet now (``reason`` says why):
    # they need more workers, or faster ones.
    out_of_reach: tuple[Target, ...] = ()


@dataclass(frozen=True, slots=True)
class _Trial:
    """A move on probation: what it was for, and where it started."""

    move: Move
    prefill_workers: int
    # The latency it was to cut ("TTFT" or "ITL") and its ratio to target then; None for a
    # move back toward aggregated serving, which must only keep both targets.
    latency: str | None
    before: float


class CapacityPlanner:
    """Keeps the smallest prefill pool that meets the targets.

    Aggregated serving is the default: every worker prefills and decodes, so no capacity sits
    idle in the wrong pool and no KV crosses a link. A split pays only when prefills interleaved
    with decodes slow the tokens, so only slow tokens split an aggregated pool. Once split, slow
    first tokens grow the pool they come from: the prefill pool if remotely prefilled requests
    are the slow ones (or its queue bursts), else the decode pool, whose own prefills are then
    the slow ones. Slow tokens grow the decode pool. Within both targets, a prefill worker goes
    back, down to aggregated serving. (A split for slow tokens needs prefills to stall enough
    of them to reach the p95: slow decode steps alone it would only make slower.)

    Every move is on probation until the loop looks again: one after which the latency it was
    for grew past the hysteresis, or that lost a target on the way back to aggregated serving,
    is undone and not tried again from the same split for a while. Each undo also waits longer
    before the next.
    """

    def __init__(self, settings: CapacitySettings | None = None) -> None:
        self.settings = settings or CapacitySettings()
        self._cooldown = 0
        self._wait = self.settings.cooldown_intervals
        self._last_move: Move | None = None
        self._last_queue: int | None = None
        self._trial: _Trial | None = None
        self._interval = 0
        # (prefill workers, move) -> how often that move failed from there, and the interval
        # until which it is not tried again.
        self._futile: dict[tuple[int, Move], tuple[int, int]] = {}
        # What the last look found out of reach, held while cooling down and through intervals
        # in which nothing finished: neither tells anything new.
        self._out_of_reach: tuple[Target, ...] = ()

    def decide(self, obs: Observation) -> Decision:
        decision = self._decide(obs)
        if decision.reason != _COOLING and obs.ttft_p95_ms is not None:
            self._out_of_reach = decision.out_of_reach
        return replace(decision, out_of_reach=self._out_of_reach)

    def _decide(self, obs: Observation) -> Decision:
        s = self.settings
        self._interval += 1
        growth = obs.prefill_queue_tokens - (self._last_queue or 0)
        self._last_queue = obs.prefill_queue_tokens
        if obs.decode_workers == 0 and obs.prefill_workers > 0:
            # Nothing serves a request (a decoder died just after a move, say): at once, not
            # after a cooldown, and on no trial.
            self._trial = None
            return self._move("to_decode", 1, "no worker decodes")
        if self._cooldown > 0:
            self._cooldown -= 1
            return Decision(None, 0, _COOLING)
        ttft = (obs.ttft_p95_ms or 0.0) / s.ttft_target_ms
        itl = (obs.itl_p95_ms or 0.0) / s.itl_target_ms
        step = max(1, int((obs.prefill_workers + obs.decode_workers) * s.max_move_fraction))
        if self._trial is not None and obs.ttft_p95_ms is not None:
            trial, self._trial = self._trial, None
            failed = self._failed(trial, ttft, itl)
            if failed is not None:
                key = (trial.prefill_workers, trial.move)
                failures = self._futile.get(key, (0, 0))[0] + 1
                backoff = min(s.max_futile_intervals, s.futile_intervals * 2 ** (failures - 1))
                self._futile[key] = (failures, self._interval + backoff)
                undo: Move = "to_decode" if trial.move == "to_prefill" else "to_prefill"
                return self._move(undo, step, failed)
        # A growing prefill queue is early warning of slow first tokens, unless they are slow
        # already and come from the decode pool: then its queue grows for want of decoders.
        local_slow = ttft > 1.0 and not _remote_slower(obs)
        burst = growth > s.burst_tokens_per_worker * max(1, obs.prefill_workers) and not local_slow
        if burst:
            ttft = max(ttft, 1.0 + s.hysteresis)
        within = f"TTFT {ttft:.2f}×, ITL {itl:.2f}× target"
        if obs.prefill_workers == 0:
            if itl > 1.0 and obs.decode_workers > step:
                why = f"ITL p95 at {itl:.2f}× target, aggregated"
                # Unless prefills stall more than the 5% of gaps past the p95, the slow gaps are
                # decode steps alone, and a prefill pool would only take decoders away.
                if obs.stalled_gap_share <= 0.05:
                    share = f"{obs.stalled_gap_share:.1%}"
                    why += f", but only {share} of gaps wait on prefills: decode steps alone"
                    return Decision(None, 0, why, ("itl",))
                return self._try("to_prefill", step, obs, "ITL", itl, why)
            if itl > 1.0:
                why = f"ITL p95 at {itl:.2f}× target, aggregated: too few workers to split"
                return Decision(None, 0, why, ("itl",))
            if ttft > 1.0:
                # Every worker prefills already: a prefill pool would only take decoders away.
                why = f"TTFT p95 at {ttft:.2f}× target, aggregated: every worker prefills already"
                return Decision(None, 0, why, ("ttft",))
            return Decision(None, 0, f"aggregated ({within})")
        if ttft > 1.0 and ttft >= itl:
            why = "prefill queue burst" if burst else f"TTFT p95 at {ttft:.2f}× target"
            if not (burst or _remote_slower(obs)):
                why += ", prefilled on the decode pool"
                return self._try("to_decode", step, obs, "TTFT", ttft, why)
            if obs.decode_workers > step:
                return self._try("to_prefill", step, obs, "TTFT", ttft, why)
            return Decision(None, 0, why + "; no decode worker to spare", ("ttft",))
        if itl > 1.0 and obs.prefill_workers >= step:
            return self._try("to_decode", step, obs, "ITL", itl, f"ITL p95 at {itl:.2f}× target")
        if obs.ttft_p95_ms is not None and max(ttft, itl) <= 1.0 - s.hysteresis:
            why = f"within targets ({within}): fewer prefill workers"
            return self._try("to_decode", step, obs, None, 0.0, why)
        return Decision(None, 0, f"near targets ({within})")

    def _failed(self, trial: _Trial, ttft: float, itl: float) -> str | None:
        """Why the move on probation is to be undone, or None if it earned its place."""
        if trial.latency is None:
            if ttft > 1.0 or itl > 1.0:
                return f"back toward aggregated lost a target (TTFT {ttft:.2f}×, ITL {itl:.2f}×)"
            return None
        after = ttft if trial.latency == "TTFT" else itl
        if after > trial.before * (1.0 + self.settings.hysteresis):
            return (
                f"{trial.latency} p95 went {trial.before:.2f}× → {after:.2f}× target "
                "after the last move"
            )
        return None

    def _try(
        self,
        move: Move,
        step: int,
        obs: Observation,
        latency: str | None,
        before: float,
        why: str,
    ) -> Decision:
        _, until = self._futile.get((obs.prefill_workers, move), (0, 0))
        if self._interval < until:
            missed: tuple[Target, ...] = () if latency is None else (_TARGETS[latency],)
            return Decision(None, 0, f"{why}; that move did not help lately", missed)
        if before <= self.settings.probation_max_ratio:
            self._trial = _Trial(move, obs.prefill_workers, latency, before)
        return self._move(move, step, why)

    def _move(self, move: Move, step: int, why: str) -> Decision:
        s = self.settings
        if self._last_move is not None and move != self._last_move:
            self._wait = min(s.max_cooldown_intervals, max(1, 2 * self._wait))
            why += f"; undoes the last move, next wait {self._wait} intervals"
        else:
            self._wait = s.cooldown_intervals
        self._last_move = move
        self._cooldown = self._wait
        return Decision(move, step, why)


_COOLING = "cooling down after the last move"
_TARGETS: dict[str, Target] = {"TTFT": "ttft", "ITL": "itl"}


def _remote_slower(obs: Observation) -> bool:
    """Do the slow first tokens come from the prefill pool?"""
    if obs.remote_ttft_p95_ms is None:
        return False
    return obs.local_ttft_p95_ms is None or obs.remote_ttft_p95_ms >= obs.local_ttft_p95_ms
