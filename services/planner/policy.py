"""Routing policies: pure functions of the request and the planner's view of the workers.

The live planner and the offline simulator call the same code, so a policy decides the same way
in both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the planner knows about one candidate worker at decision time."""

    worker_id: str
    running: int
    waiting: int
    kv_usage: float
    # Requests this planner routed there that have not ended yet; fresher than load reports.
    in_flight: int
    cached_blocks: int = 0

    @property
    def load(self) -> int:
        # Reports lag behind routing; the planner's own count covers the gap between reports.
        return max(self.running + self.waiting, self.in_flight)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    # Cost per candidate worker; lower is better.
    scores: dict[str, float]
    reason: str


class Policy(Protocol):
    name: str
    # Whether the policy needs per-worker prefix overlap (an index query) to decide.
    needs_overlap: bool

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice: ...


class RoundRobin:
    name = "round_robin"
    needs_overlap = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        scores = {w.worker_id: 0.0 if w is pick else 1.0 for w in ordered}
        return Choice(pick.worker_id, scores, "next in rotation")


class RandomChoice:
    name = "random"
    needs_overlap = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = self._rng.choice(ordered)
        scores = {w.worker_id: 0.0 if w is pick else 1.0 for w in ordered}
        return Choice(pick.worker_id, scores, "uniformly random")


class LeastLoaded:
    name = "least_loaded"
    needs_overlap = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        scores = {w.worker_id: w.load + w.kv_usage for w in workers}
        best = min(scores.values())
        tied = sorted(w for w, s in scores.items() if s == best)
        # Rotate among equals so that an idle cluster is not filled from one end.
        pick = tied[self._turn % len(tied)]
        self._turn += 1
        return Choice(pick, scores, f"least loaded ({best:g} requests + KV usage)")


POLICIES: dict[str, Callable[[int], Policy]] = {
    "round_robin": lambda seed: RoundRobin(),
    "random": lambda seed: RandomChoice(seed),
    "least_loaded": lambda seed: LeastLoaded(),
}


def make_policy(name: str, seed: int = 0) -> Policy:
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
