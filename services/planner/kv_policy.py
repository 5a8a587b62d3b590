"""The `kv` policy: send each request where it will see its first token soonest.

For every candidate it predicts the time to first token from what the planner knows: the prompt
tokens already queued there, the part of this prompt that worker does not cache, and the step
times of the worker's perf model (chunked prefill sharing each step with the running decodes):
the step costs it measured on its own hardware where it reported them, else the preset.
A decode-load penalty keeps long generations off crowded workers, and the KV a worker already
holds (which slows every decode step there) counts against it. Hot spots need no special
rule: a worker that owns a popular prefix stops winning as soon as its queue costs more than
recomputing the prefix elsewhere.

Beyond one worker's GPU memory: blocks in a worker's host tier load at the PCIe link's cost, and
with ``moves`` a candidate may instead pull the prompt's KV from the worker caching most of it
(GPU or host tier) over the link between the two (NVLink within a node, RDMA across), then
prefill the rest. Each candidate is predicted both ways and keeps the sooner, so the choice is
run on the owner (queue there), move the KV to a less loaded worker, or recompute elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from annotated_types import Ge, Gt

from schemas.events import KvMove, TtftAlternative
from services.common.kv_transfer import PCIE_LATENCY_MS, KvTransferModel, LinkModel, sized
from services.common.perf_model import PerfModel, measured_perf, perf_model
from services.planner.policy import Choice, RouteRequest, WorkerView, decision_rng

_Positive = Annotated[float, Gt(0)]
_Weight = Annotated[float, Ge(0)]


@dataclass(frozen=True, slots=True)
class KvSettings:
    """The kv policy's knobs. A live planner reads each as ``LANEWAY_KV_<NAME>``
    (``LANEWAY_KV_DECODE_WEIGHT``; services.planner.main.PlannerSettings), but for the four it
    derives from settings it shares: ``perf_model``, ``itl_target_ms``, ``kv_bytes_per_token``,
    and the speed-up ``ttft_target_ms`` is scaled by."""

    # Perf model of the workers that report no measured step costs (simulated ones, and real
    # ones until they have run enough steps), and the workers' prefill budget per step.
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
    # A session's owner keeps it unless another worker is predicted this much sooner (ms).
    session_slack_ms: float = 1000.0
    # Predicted costs this close (ms) count as a tie, broken by load.
    tie_ms: float = 0.0
    # KV bytes a token's cache takes, and the PCIe link a host-tier hit loads over (GB/s).
    kv_bytes_per_token: int = 131_072
    host_link_gb_s: _Positive = 25.0
    # Weigh pulling the prompt's KV from the worker caching most of it; off, KV is only ever
    # recomputed. The worker told to move pulls the blocks from the holder
    # (services/worker/kv_move.py); what goes wrong on the way costs a recompute, never the
    # request. A move must be predicted this much sooner (ms) than both running on that
    # worker and recomputing: predictions err, and a copy of the KV evicts other blocks where
    # it lands. The links between two workers, as their registrations place them (GB/s): same
    # node, same rack, across racks.
    moves: bool = False
    move_margin_ms: float = 50.0
    node_link_gb_s: _Positive = 300.0
    rack_link_gb_s: _Positive = 50.0
    cross_link_gb_s: _Positive = 25.0
    # Urgency: a high-priority request's predicted wait for its first token weighs this many
    # times its ms, a low one's this fraction; past ``ttft_target_ms`` (0: none; ms as clients
    # see them) each further ms costs ``ttft_miss_weight`` more. Waiting on the KV's owner,
    # moving the KV and recomputing are weighed alike, so an urgent request moves or
    # recomputes for a gain a normal one would wait out.
    # Loading a LoRA adapter that a worker does not hold, before the request's prefill (ms).
    lora_load_ms: _Weight = 150.0
    high_priority_weight: _Weight = 2.0
    low_priority_weight: _Weight = 0.5
    ttft_target_ms: _Weight = 0.0
    ttft_miss_weight: _Weight = 4.0


@dataclass(frozen=True, slots=True)
class Prediction:
    queue_ms: float
    # Its own prefill, host-tier loads included.
    prefill_ms: float
    decode_penalty_ms: float
    # A KV move before it queues: the source worker, the blocks it sends and their transfer.
    move_from: str | None = None
    move_blocks: int = 0
    move_ms: float = 0.0
    # What the request's urgency adds to its predicted TTFT (0 for a normal one on target).
    urgency_ms: float = 0.0

    @property
    def ttft_ms(self) -> float:
        return self.move_ms + self.queue_ms + self.prefill_ms

    @property
    def wait_cost_ms(self) -> float:
        """Its predicted TTFT as this request's urgency weighs it."""
        return self.ttft_ms + self.urgency_ms

    @property
    def cost(self) -> float:
        return self.wait_cost_ms + self.decode_penalty_ms


class KvAware:
    name = "kv"

    def __init__(self, settings: KvSettings | None = None, seed: int = 0) -> None:
        self.settings = settings or KvSettings()
        self._perf: PerfModel = perf_model(self.settings.perf_model)
        s = self.settings
        self._host_link = KvTransferModel(s.kv_bytes_per_token, s.host_link_gb_s, PCIE_LATENCY_MS)
        defaults = LinkModel()
        self.links = LinkModel(
            KvTransferModel(s.kv_bytes_per_token, s.node_link_gb_s, defaults.same_node.latency_ms),
            KvTransferModel(s.kv_bytes_per_token, s.rack_link_gb_s, defaults.same_rack.latency_ms),
            KvTransferModel(
                s.kv_bytes_per_token, s.cross_link_gb_s, defaults.across_racks.latency_ms
            ),
        )
        self._seed = seed
        self.turn = 0

    def wants_overlap(self, request: RouteRequest) -> bool:
        """Every prompt: routing short ones by load alone (power of two choices, no index
        query) lost on every trace measured (docs/routing.md, "Traffic tiering")."""
        return True

    def choose(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        handoff: frozenset[str] = frozenset(),
    ) -> Choice:
        """``handoff``: the workers whose engines send and take a prompt's KV, the only ends a
        move may have (another engine would recompute what was counted as moved)."""
        source = None
        if self.settings.moves:
            source = _deepest([w for w in workers if w.worker_id in handoff])
        predictions = {
            w.worker_id: self._sooner(request, w, source if w.worker_id in handoff else None)
            for w in workers
        }
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
        move = None
        if top.move_from is not None:
            move = self._explain_move(request, workers, top, best)
            reason += f"; {top.move_blocks} blocks pulled from {top.move_from}"
        return Choice(
            best,
            costs,
            f"{reason}: {cached} cached blocks, queue {top.queue_ms:.0f} ms, "
            f"prefill {top.prefill_ms:.0f} ms",
            {w: (p.queue_ms, p.prefill_ms) for w, p in predictions.items()},
            move,
        )

    def _sooner(
        self, request: RouteRequest, worker: WorkerView, source: WorkerView | None
    ) -> Prediction:
        """The cheaper of recomputing what ``worker`` lacks and pulling it from ``source``; a
        move is only for a first token sooner than on ``source`` itself (its queue is long)."""
        local = self.predict(request, worker)
        if source is None or source.worker_id == worker.worker_id:
            return local
        moved = self.predict(request, worker, source)
        margin = self.settings.move_margin_ms
        sooner = moved.wait_cost_ms + margin < self.predict(request, source).wait_cost_ms
        pays = sooner and moved.cost + margin < local.cost
        return moved if moved.move_from is not None and pays else local

    def _explain_move(
        self, request: RouteRequest, workers: Sequence[WorkerView], top: Prediction, best: str
    ) -> KvMove:
        """The move chosen, beside running on the KV's owner and the best recompute."""
        owner = next(w for w in workers if w.worker_id == top.move_from)
        others = [w for w in workers if w.worker_id != owner.worker_id]
        recompute = min(others, key=lambda w: (self.predict(request, w).cost, w.worker_id))
        options = [
            ("owner", owner, self.predict(request, owner)),
            ("move", next(w for w in workers if w.worker_id == best), top),
            ("recompute", recompute, self.predict(request, recompute)),
        ]
        return KvMove(
            source_worker_id=owner.worker_id,
            blocks=top.move_blocks,
            transfer_ms=top.move_ms,
            alternatives=tuple(
                TtftAlternative(action=a, worker_id=w.worker_id, predicted_ttft_ms=p.ttft_ms)
                for a, w, p in options
            ),
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

    def predict(
        self, request: RouteRequest, worker: WorkerView, source: WorkerView | None = None
    ) -> Prediction:
        """TTFT and penalties on ``worker``; with ``source``, after pulling from it the prompt's
        KV it caches beyond what ``worker`` has (no move when it has nothing more)."""
        bs, limit = worker.block_size, request.prompt_tokens - 1
        cached = max(0, min(worker.cached_blocks * bs, limit))
        host = max(0, min(worker.host_blocks * bs, limit - cached))
        move_from, move_blocks, move_ms = None, 0, 0.0
        if source is not None:
            depth = min((source.cached_blocks + source.host_blocks) * bs, limit)
            moved = max(0, depth - cached - host) // bs * bs
            if moved:
                link = sized(
                    self.links.between((source.node, source.rack), (worker.node, worker.rack)),
                    worker.kv_bytes_per_token,
                )
                move_from, move_blocks = source.worker_id, moved // bs
                move_ms = link.transfer_ms(moved)
                host += moved  # arrives before the request queues: like a host hit, not computed
        uncached = request.prompt_tokens - cached - host
        queued = worker.waiting_prefill_tokens
        # The adapters the requests ahead load stall the steps that run them.
        queue_ms = self._prefill_ms(queued, worker)
        queue_ms += worker.lora_loads_ahead * self.settings.lora_load_ms
        prefill_ms = self._prefill_ms(queued + uncached, worker) - self._prefill_ms(queued, worker)
        host_link = sized(self._host_link, worker.kv_bytes_per_token)
        prefill_ms += host_link.transfer_ms(host - move_blocks * bs)
        if request.lora is not None and request.lora not in worker.loras:
            prefill_ms += self.settings.lora_load_ms
        output = request.output_tokens
        # Decode steps slow down as the worker's KV fills (the perf model's decode term), and
        # this request's tokens will be generated at that pace: long answers weigh more.
        step_ms = self.decode_step_ms(worker, uncached + output)
        penalty = self.settings.decode_weight * max(1, output) * step_ms
        penalty += self.settings.stall_weight * worker.running * self._prefill_ms(uncached, worker)
        target = self.settings.itl_target_ms
        if target and self.decode_step_ms(worker, request.prompt_tokens + output) > target:
            slow_tokens = max(1, output) * (1 + worker.running)
            penalty += self.settings.slow_step_ms_per_token * slow_tokens
        urgency = self._urgency_ms(request, move_ms + queue_ms + prefill_ms)
        return Prediction(queue_ms, prefill_ms, penalty, move_from, move_blocks, move_ms, urgency)

    def _urgency_ms(self, request: RouteRequest, ttft_ms: float) -> float:
        s = self.settings
        weight = {"high": s.high_priority_weight, "low": s.low_priority_weight}.get(
            request.priority, 1.0
        )
        late = max(0.0, ttft_ms - s.ttft_target_ms) if s.ttft_target_ms > 0 else 0.0
        return (weight - 1.0) * ttft_ms + s.ttft_miss_weight * late

    def _held_kv_ms(self, worker: WorkerView) -> float:
        held_blocks = worker.kv_usage * worker.kv_capacity_tokens / worker.block_size
        return self.settings.balance_ms_per_block * held_blocks

    def decode_step_ms(self, worker: WorkerView, extra_tokens: int = 0) -> float:
        """A decode step's time on ``worker`` once it holds ``extra_tokens`` more tokens of KV."""
        usage = worker.kv_usage
        if worker.kv_capacity_tokens:
            usage += extra_tokens / worker.kv_capacity_tokens
        return self._perf_of(worker).step_ms(0, 1, min(1.0, usage))

    def _perf_of(self, worker: WorkerView) -> PerfModel:
        """The worker's own measured step costs where it reported them, else the preset."""
        return self._perf if worker.step_cost is None else measured_perf(worker.step_cost)

    def _prefill_ms(self, tokens: int, worker: WorkerView) -> float:
        """Time to prefill ``tokens`` in budget-sized chunks, each step also decoding."""
        if tokens <= 0:
            return 0.0
        budget = self.settings.max_num_batched_tokens
        full, rest = divmod(tokens, budget)
        decoding, perf = worker.running, self._perf_of(worker)
        ms = full * perf.step_ms(budget, decoding, worker.kv_usage)
        if rest:
            ms += perf.step_ms(rest, decoding, worker.kv_usage)
        return ms

    def _softmax(self, request: RouteRequest, costs: dict[str, float]) -> str:
        low = min(costs.values())
        names = sorted(costs)
        weights = [math.exp(-(costs[w] - low) / self.settings.temperature) for w in names]
        return decision_rng(self._seed, request).choices(names, weights)[0]


def _deepest(workers: Sequence[WorkerView]) -> WorkerView | None:
    """The worker caching most of the prompt in either tier: where a move would pull from."""
    best = max(workers, key=lambda w: (w.cached_blocks + w.host_blocks, w.worker_id), default=None)
    if best is None or best.cached_blocks + best.host_blocks == 0:
        return None
    return best
