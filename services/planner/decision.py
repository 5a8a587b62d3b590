"""The routing decision: one pure function from what the planner knows to where a request goes.

The live planner only does I/O around it (the overlap query, the session claim in etcd, the
publish); the offline replay and the replayer call it unchanged, so that the simulator predicts
the live system instead of a copy of it that drifts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import TypeAdapter

from schemas.events import KvMove, PrefillPlacement, RouteCandidate, RouteDecided
from schemas.trusted import trusted
from services.planner.disagg import DisaggSettings, pick_decoder, plan_prefill
from services.planner.kv_policy import KvAware
from services.planner.policy import Choice, Policy, RouteRequest, WorkerView

_FIELDS: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


@dataclass(frozen=True, slots=True)
class DecisionInputs:
    """Everything one decision depends on, as the planner sees it at that moment."""

    request: RouteRequest
    # Workers that can decode it (role both or decode, not draining), with the blocks of its
    # prompt they cache and whether they own its session.
    decoders: Sequence[WorkerView]
    # Prefill-only workers that can hand their KV over, likewise.
    prefillers: Sequence[WorkerView] = ()
    # Decode workers whose engine can take a prompt's KV from a prefill worker.
    handoff: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    policy: str
    reason: str
    # Every decode worker weighed, with the inputs of its cost.
    candidates: tuple[RouteCandidate, ...]
    # The disaggregation decision; None when there was no prefill pool to weigh.
    prefill: PrefillPlacement | None
    # Uncached prompt tokens that now queue where the prompt is prefilled: the planner counts
    # them there until a load report includes them.
    queued_tokens: int
    # The policy's turn before it decided: with the inputs, all it takes to decide again.
    policy_turn: int = 0
    # KV the decode worker pulls from another worker before prefilling, and why.
    kv_move: KvMove | None = None
    # The output length the cost model assumed (None: the request's max_tokens).
    expected_output_tokens: int | None = None

    @property
    def prefill_worker_id(self) -> str | None:
        return self.prefill.prefill_worker_id if self.prefill is not None else None

    def route_fields(self) -> dict[str, Any]:
        """The fields of ``RouteDecided`` this decision fills (the offline dump has the same)."""
        return {
            "worker_id": self.worker_id,
            "policy": self.policy,
            "reason": self.reason,
            "candidates": self.candidates,
            "prefill": self.prefill,
            "policy_turn": self.policy_turn,
            "kv_move": self.kv_move,
            "expected_output_tokens": self.expected_output_tokens,
        }

    def record(self, request_id: str) -> dict[str, Any]:
        """The decision as ``laneway bench --decisions`` writes it: the fields live
        ``RouteDecided`` events carry, named alike."""
        return {"request_id": request_id, **_FIELDS.dump_python(self.route_fields(), mode="json")}


def decide(policy: Policy, disagg: DisaggSettings, inputs: DecisionInputs) -> Decision:
    """Pick the decode worker, then whether the prompt is prefilled there or on a prefill
    worker; a remotely prefilled request decodes where its tokens will come soonest."""
    request, decoders = inputs.request, inputs.decoders
    turn = policy.turn
    if isinstance(policy, KvAware):
        choice = policy.choose(request, decoders, inputs.handoff)
    else:
        choice = policy.choose(request, decoders)
    worker_id, reason, move = choice.worker_id, choice.reason, choice.move
    placement = _place_prefill(policy, disagg, inputs, _view(decoders, worker_id))
    if placement is not None and placement.prefill_worker_id is not None:
        move = None  # the prompt is computed on the prefill worker instead
        assert isinstance(policy, KvAware)  # only its cost model places prefills
        able = [c for c in decoders if c.worker_id in inputs.handoff]
        prefill = _view(inputs.prefillers, placement.prefill_worker_id)
        worker_id = pick_decoder(policy, request, able, disagg, prefill).worker_id
        reason = f"decodes here after a remote prefill (first pick: {reason})"
    return Decision(
        worker_id=worker_id,
        policy=policy.name,
        reason=reason,
        candidates=tuple(_candidate(c, choice, inputs) for c in decoders),
        prefill=placement,
        queued_tokens=_queued_tokens(inputs, worker_id, placement, move),
        policy_turn=turn,
        kv_move=move,
        expected_output_tokens=request.expected_tokens,
    )


def inputs_of(event: RouteDecided) -> DecisionInputs:
    """The inputs a recorded decision was made from, as its event carries them."""
    spec = event.spec
    request = RouteRequest(
        event.request_id or "",
        spec.prompt_length,
        spec.block_hashes,
        event.session_id,
        spec.sampling.max_tokens,
        event.expected_output_tokens,
        spec.priority,
        spec.sampling.structured_output is not None,
        spec.lora,
    )
    prefillers = event.prefill.candidates if event.prefill is not None else ()
    weighed = (*event.candidates, *prefillers)
    return DecisionInputs(
        request,
        [_view_of(c, spec.lora) for c in event.candidates],
        [_view_of(c, spec.lora) for c in prefillers],
        frozenset(c.worker_id for c in weighed if c.kv_handoff),
    )


def _view_of(candidate: RouteCandidate, lora: str | None) -> WorkerView:
    """The worker as the decision saw it; of its adapters, only whether it held the request's."""
    return WorkerView(
        worker_id=candidate.worker_id,
        running=candidate.running,
        waiting=candidate.waiting,
        kv_usage=candidate.kv_usage,
        in_flight=candidate.in_flight,
        cached_blocks=candidate.cached_blocks,
        waiting_prefill_tokens=candidate.waiting_prefill_tokens,
        block_size=candidate.block_size,
        kv_capacity_tokens=candidate.kv_capacity_tokens,
        owns_session=candidate.owns_session,
        host_blocks=candidate.host_blocks,
        node=candidate.node,
        rack=candidate.rack,
        step_cost=candidate.step_cost,
        kv_bytes_per_token=candidate.kv_bytes_per_token,
        loras=frozenset({lora}) if candidate.lora_resident and lora is not None else frozenset(),
        lora_loads_ahead=candidate.lora_loads_ahead,
    )


# The reason of a decision rebound to the worker another planner replica bound its session to
# first: etcd's answer, which a replay takes from the record as it takes the other inputs.
REBOUND = "session claimed by another planner replica first"


def rebind(decision: Decision, inputs: DecisionInputs, worker_id: str) -> Decision:
    """The same decision, decoded on ``worker_id`` instead (a session another planner replica
    bound first); a KV move it planned to another worker is off."""
    return replace(
        decision,
        worker_id=worker_id,
        reason=REBOUND,
        queued_tokens=_queued_tokens(inputs, worker_id, decision.prefill),
        kv_move=None,
    )


def _place_prefill(
    policy: Policy, disagg: DisaggSettings, inputs: DecisionInputs, decode: WorkerView
) -> PrefillPlacement | None:
    if disagg.mode == "never" or not isinstance(policy, KvAware) or not inputs.prefillers:
        return None
    request = inputs.request
    candidates = []
    for worker in inputs.prefillers:
        p = policy.predict(request, worker)
        candidates.append(_route_candidate(worker, inputs, p.cost, p.queue_ms, p.prefill_ms))
    # A one-token answer has nothing to decode after a hand-off.
    if request.max_tokens <= 1 or request.no_handoff or decode.worker_id not in inputs.handoff:
        return PrefillPlacement(
            prefill_worker_id=None,
            local_ms=policy.predict(request, decode).cost,
            reason="no hand-off: response_format" if request.no_handoff else "no hand-off",
            candidates=tuple(candidates),
        )
    plan = plan_prefill(policy, request, decode, inputs.prefillers, disagg)
    return PrefillPlacement(
        prefill_worker_id=plan.prefill_worker,
        local_ms=plan.local_ms,
        remote_ms=plan.remote_ms,
        reason=plan.reason,
        candidates=tuple(candidates),
    )


def _queued_tokens(
    inputs: DecisionInputs,
    worker_id: str,
    prefill: PrefillPlacement | None,
    move: KvMove | None = None,
) -> int:
    """The prompt queues where it is prefilled, less what that worker caches or is sent."""
    view = _view(inputs.decoders, worker_id)
    cached = view.cached_blocks + view.host_blocks + (move.blocks if move is not None else 0)
    if prefill is not None and prefill.prefill_worker_id is not None:
        cached = next(
            c.cached_blocks for c in prefill.candidates if c.worker_id == prefill.prefill_worker_id
        )
    return max(0, inputs.request.prompt_tokens - cached * view.block_size)


def _view(workers: Sequence[WorkerView], worker_id: str) -> WorkerView:
    return next(w for w in workers if w.worker_id == worker_id)


def _candidate(view: WorkerView, choice: Choice, inputs: DecisionInputs) -> RouteCandidate:
    queue_ms, prefill_ms = choice.predictions.get(view.worker_id, (None, None))
    return _route_candidate(view, inputs, choice.costs[view.worker_id], queue_ms, prefill_ms)


def _route_candidate(
    view: WorkerView,
    inputs: DecisionInputs,
    cost: float,
    queue_ms: float | None,
    prefill_ms: float | None,
) -> RouteCandidate:
    lora = inputs.request.lora
    # Unvalidated (a fifth of a validation's time, every candidate of every decision): the view's
    # counts come from checked reports and registrations and the planner's own counters, and the
    # floats are made floats here, as validating would.
    return trusted(
        RouteCandidate,
        {
            "worker_id": view.worker_id,
            "cached_blocks": view.cached_blocks,
            "running": view.running,
            "waiting": view.waiting,
            "kv_usage": float(min(1.0, view.kv_usage)),
            "in_flight": view.in_flight,
            "waiting_prefill_tokens": view.waiting_prefill_tokens,
            "block_size": view.block_size,
            "kv_capacity_tokens": view.kv_capacity_tokens,
            "owns_session": view.owns_session,
            "kv_handoff": view.worker_id in inputs.handoff,
            "cost": float(cost),
            "predicted_queue_ms": None if queue_ms is None else float(queue_ms),
            "predicted_prefill_ms": None if prefill_ms is None else float(prefill_ms),
            "host_blocks": view.host_blocks,
            "node": view.node,
            "rack": view.rack,
            "step_cost": view.step_cost,
            "kv_bytes_per_token": view.kv_bytes_per_token,
            "lora_resident": None if lora is None else lora in view.loras,
            "lora_loads_ahead": view.lora_loads_ahead,
        },
    )
