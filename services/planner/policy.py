"""Routing policies: pure functions of the request and the planner's view of the workers.

The live planner and the offline simulator call the same code, so a policy decides the same way
in both.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas.events import KvMove, StepCost

# Admission control's classes, as a request's spec carries them.
Priority = Literal["high", "normal", "low"]


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the planner knows about one candidate worker at decision time."""

    worker_id: str
    running: int
    waiting: int
    kv_usage: float
    # Requests this planner routed there that have not ended yet; fresher than load reports.
    in_flight: int
    # Leading blocks of the request's prompt that the worker caches (from the kv-indexer).
    cached_blocks: int = 0
    # Prompt tokens queued for prefill there, including routes not yet in a load report.
    waiting_prefill_tokens: int = 0
    block_size: int = 16
    # KV cache size in tokens (blocks × block size); 0 if unknown.
    kv_capacity_tokens: int = 0
    # This worker owns the request's session (its conversation's cache lives there).
    owns_session: bool = False
    # Blocks after ``cached_blocks`` in its host-memory tier: loaded, not recomputed, there.
    host_blocks: int = 0
    # Where it runs ('' unknown): the link a KV move to or from it takes depends on it.
    node: str = ""
    rack: str = ""
    # Its step times as it measured them; None: the policy's perf model stands in.
    step_cost: StepCost | None = None
    # Bytes a token's KV takes there; 0: the policy's configured size.
    kv_bytes_per_token: int = 0
    # The LoRA adapters resident there by the time a request routed now runs, and the loads
    # the requests ahead of it make first (services.planner.adapters).
    loras: frozenset[str] = frozenset()
    lora_loads_ahead: int = 0

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
    max_tokens: int = 0
    # The output length the planner expects (a predictor's), at most ``max_tokens``; None:
    # assume ``max_tokens``.
    expected_tokens: int | None = None
    priority: Priority = "normal"
    # Its answer must come from one engine from the first token on (a response_format: an
    # engine's grammar cannot go on from a token another engine sampled): no remote prefill.
    no_handoff: bool = False
    # The LoRA adapter it runs with (None: the base model): a worker where it is not resident
    # loads it first.
    lora: str | None = None

    @property
    def output_tokens(self) -> int:
        """Output tokens the cost model assumes."""
        return self.max_tokens if self.expected_tokens is None else self.expected_tokens


@dataclass(frozen=True, slots=True)
class Choice:
    worker_id: str
    # Cost per candidate worker; lower is better.
    costs: dict[str, float]
    reason: str
    # Per candidate, when the policy predicts them: (queueing ms, own prefill ms).
    predictions: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The KV the chosen worker pulls from another first, and the options weighed; None: none.
    move: KvMove | None = None


def decision_rng(seed: int, request: RouteRequest) -> random.Random:
    """The randomness of one decision: drawn from the seed and the request alone, so that a
    replay of the decision draws the same whatever was decided before it."""
    return random.Random(f"{seed}/{request.request_id}")


class Policy(Protocol):
    name: str
    # Decisions the policy has rotated through: the one state a decision depends on besides its
    # inputs (round robin and tie-breaks turn on it). Each decision records it, and a replay sets
    # it back to that before deciding again.
    turn: int

    def wants_overlap(self, request: RouteRequest) -> bool:
        """Whether deciding this request needs per-worker prefix overlap (an index query)."""
        ...

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice: ...


class RoundRobin:
    name = "round_robin"

    def wants_overlap(self, request: RouteRequest) -> bool:
        return False

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = ordered[self.turn % len(ordered)]
        self.turn += 1
        costs = {w.worker_id: 0.0 if w is pick else 1.0 for w in ordered}
        return Choice(pick.worker_id, costs, "next in rotation")


class RandomChoice:
    name = "random"

    def wants_overlap(self, request: RouteRequest) -> bool:
        return False

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self.turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pick = decision_rng(self._seed, request).choice(ordered)
        costs = {w.worker_id: 0.0 if w is pick else 1.0 for w in ordered}
        return Choice(pick.worker_id, costs, "uniformly random")


class LeastLoaded:
    name = "least_loaded"

    def wants_overlap(self, request: RouteRequest) -> bool:
        return False

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        costs = {w.worker_id: w.load + w.kv_usage for w in workers}
        best = min(costs.values())
        tied = sorted(w for w, s in costs.items() if s == best)
        # Rotate among equals so that an idle cluster is not filled from one end.
        pick = tied[self.turn % len(tied)]
        self.turn += 1
        return Choice(pick, costs, f"least loaded ({best:g} requests + KV usage)")
