"""The `kv` policy: send each request where it will see its first token soonest.

For every candidate it predicts the time to first token from what the planner knows: the prompt
tokens already queued there, the part of this prompt that worker does not cache, and the step
times of the worker's perf model (chunked prefill sharing each step with the running decodes).
A decode-load penalty keeps long generations off crowded workers, and the KV a worker already
holds (which slows every decode step there) counts against it. Hot spots need no special
rule: a worker that owns a popular prefix stops winning as soon as its queue costs more than
recomputing the prefix elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.perf_model import PerfModel, perf_model
from services.planner.policy import Choice, RouteRequest, WorkerView, decision_rng


@dataclass(frozen=True, slots=True)
class KvSettings:
    # Perf model of the workers (homogeneous pool) and their prefill budget per step.
    perf_model: str = "dynamo-mocker"
    max_num_batched_tokens: int = 8192
    # Weight of the decode-load penalty: predicted ms added per running request there, per
    # output token the request may generate, scaled by the step-time slope.
    decode_weight: float = 0.0
    # Weight of the stall this prefill imposes on the requests decoding there: each of them
    # waits out every prefill chunk, so the harm is the prefill time times their number.
    stall_weight: float = 0.2
    # Milliseconds per block of KV the worker's running requests hold: every decode step there
    # slows as its KV fills, so a decode worker already holding much KV costs more. Only the
    # choice of decode worker weighs it; whether to prefill elsewhere does not, since the KV
    # ends up on the decode worker either way.
    balance_ms_per_block: float = 0.25
    # When this request's KV would take the worker's decode step past `itl_target_ms`, every
    # request there (itself included) would see slow tokens: that costs this many ms per token
    # the request may generate, times their number. 0 target: off.
    itl_target_ms: float = 0.0
    slow_step_ms_per_token: float = 0.25
    # 0 picks the cheapest; above 0, picks by softmax over -cost/temperature (ms).
    temperature: float = 0.0
    # Prompts shorter than this with no session skip the index: two random choices on load.
    short_prompt_tokens: int = 0
    # A session's owner keeps it unless another worker is predicted this much sooner (ms).
    session_slack_ms: float = 1000.0
    # Predicted costs this close (ms) count as a tie, broken by load.
    tie_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    queue_ms: float
    prefill_ms: float
    decode_penalty_ms: float

    @property
    def cost(self) -> float:
        return self.queue_ms + self.prefill_ms + self.decode_penalty_ms


class KvAware:
    name = "kv"

    def __init__(self, settings: KvSettings | None = None, seed: int = 0) -> None:
        self.settings = settings or KvSettings()
        self._perf: PerfModel = perf_model(self.settings.perf_model)
        self._seed = seed
        self.turn = 0

    def wants_overlap(self, request: RouteRequest) -> bool:
        """Short prompts outside a session go down the cheap path, with no index query."""
        return request.session_id is not None or not self._short(request)

    def _short(self, request: RouteRequest) -> bool:
        return request.prompt_tokens < self.settings.short_prompt_tokens

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        if request.session_id is None and self._short(request):
            return self._two_choices(request, workers)
        predictions = {w.worker_id: self.predict(request, w) for w in workers}
        costs = {w.worker_id: predictions[w.worker_id].cost + self._held_kv_ms(w) for w in workers}
        best = self._cheapest(costs, workers)
        reason = "lowest predicted TTFT"
        owner = next((w for w in workers if w.owns_session), None)
        if owner is not None and owner.worker_id != best:
            if costs[owner.worker_id] - costs[best] <= self.settings.session_slack_ms:
                best, reason = owner.worker_id, "session owner, within the slack"
            else:
                reason = "session owner too busy; moved"
        elif owner is not None:
            reason = "session owner and lowest predicted TTFT"
        elif self.settings.temperature > 0:
            best = self._softmax(request, costs)
            reason = "softmax over predicted TTFT"
        top = predictions[best]
        cached = next(w.cached_blocks for w in workers if w.worker_id == best)
        return Choice(
            best,
            costs,
            f"{reason}: {cached} cached blocks, queue {top.queue_ms:.0f} ms, "
            f"prefill {top.prefill_ms:.0f} ms",
            {w: (p.queue_ms, p.prefill_ms) for w, p in predictions.items()},
        )

    def _cheapest(self, costs: dict[str, float], workers: Sequence[WorkerView]) -> str:
        # Costs within a tie margin are equal for any purpose: spread such ties by load, then in
        # turn, or idle clusters fill from one end and utilisation drifts apart.
        low = min(costs.values()) + self.settings.tie_ms
        tied = sorted(
            (w.load, w.kv_usage, w.worker_id) for w in workers if costs[w.worker_id] <= low
        )
        least = [name for load, usage, name in tied if (load, usage) == tied[0][:2]]
        self.turn += 1
        return least[self.turn % len(least)]

    def predict(self, request: RouteRequest, worker: WorkerView) -> Prediction:
        cached = min(worker.cached_blocks * worker.block_size, request.prompt_tokens - 1)
        uncached = request.prompt_tokens - max(0, cached)
        queued = worker.waiting_prefill_tokens
        queue_ms = self._prefill_ms(queued, worker)
        prefill_ms = self._prefill_ms(queued + uncached, worker) - queue_ms
        # Decode steps slow down as the worker's KV fills (the perf model's decode term), and
        # this request's tokens will be generated at that pace: long answers weigh more.
        step_ms = self.decode_step_ms(worker, uncached + request.max_tokens)
        penalty = self.settings.decode_weight * max(1, request.max_tokens) * step_ms
        penalty += self.settings.stall_weight * worker.running * self._prefill_ms(uncached, worker)
        target = self.settings.itl_target_ms
        if (
            target
            and self.decode_step_ms(worker, request.prompt_tokens + request.max_tokens) > target
        ):
            slow_tokens = max(1, request.max_tokens) * (1 + worker.running)
            penalty += self.settings.slow_step_ms_per_token * slow_tokens
        return Prediction(queue_ms, prefill_ms, penalty)

    def _held_kv_ms(self, worker: WorkerView) -> float:
        held_blocks = worker.kv_usage * worker.kv_capacity_tokens / worker.block_size
        return self.settings.balance_ms_per_block * held_blocks

    def decode_step_ms(self, worker: WorkerView, extra_tokens: int = 0) -> float:
        """A decode step's time on ``worker`` once it holds ``extra_tokens`` more tokens of KV."""
        usage = worker.kv_usage
        if worker.kv_capacity_tokens:
            usage += extra_tokens / worker.kv_capacity_tokens
        return self._perf.step_ms(0, 1, min(1.0, usage))

    def _prefill_ms(self, tokens: int, worker: WorkerView) -> float:
        """Time to prefill ``tokens`` in budget-sized chunks, each step also decoding."""
        if tokens <= 0:
            return 0.0
        budget = self.settings.max_num_batched_tokens
        full, rest = divmod(tokens, budget)
        decoding = worker.running
        ms = full * self._perf.step_ms(budget, decoding, worker.kv_usage)
        if rest:
            ms += self._perf.step_ms(rest, decoding, worker.kv_usage)
        return ms

    def _two_choices(self, request: RouteRequest, workers: Sequence[WorkerView]) -> Choice:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        pair = decision_rng(self._seed, request).sample(ordered, min(2, len(ordered)))
        pick = min(pair, key=lambda w: (w.load, w.worker_id))
        costs = {w.worker_id: float(w.load) for w in ordered}
        return Choice(pick.worker_id, costs, "short prompt: less loaded of two random workers")

    def _softmax(self, request: RouteRequest, costs: dict[str, float]) -> str:
        low = min(costs.values())
        names = sorted(costs)
        weights = [math.exp(-(costs[w] - low) / self.settings.temperature) for w in names]
        return decision_rng(self._seed, request).choices(names, weights)[0]
