"""LoRA adapters in the kv policy: a worker that does not hold the request's adapter is
predicted its load before the prefill, weighed against queues and cached prefixes, and a
replay reads from the record which candidates held it."""

from __future__ import annotations

import dataclasses

from schemas import codec
from schemas.events import RouteDecided
from services.planner.decision import Decision, DecisionInputs, decide, inputs_of
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.policy import RouteRequest, WorkerView
from services.planner.replay import differences, redecide
from tests.planner.recorded import SPEC

NEVER = DisaggSettings(mode="never")
REQUEST = RouteRequest("r1", 1000, SPEC.block_hashes, max_tokens=40, lora="lora-3")


def _decide(queued_on_holder: int, request: RouteRequest = REQUEST) -> Decision:
    """``a`` holds the adapter behind ``queued_on_holder`` prompt tokens; ``b`` is idle."""
    idle = WorkerView("b", running=0, waiting=0, kv_usage=0.0, in_flight=0)
    holder = dataclasses.replace(
        idle, worker_id="a", loras=frozenset({"lora-3"}), waiting_prefill_tokens=queued_on_holder
    )
    return decide(
        KvAware(KvSettings(lora_load_ms=150.0)), NEVER, DecisionInputs(request, [holder, idle])
    )


def test_the_worker_holding_the_adapter_wins_until_its_queue_costs_more_than_a_load() -> None:
    held = _decide(queued_on_holder=0)
    assert held.worker_id == "a"
    a, b = held.candidates
    assert (a.lora_resident, b.lora_resident) == (True, False)
    # b's prediction carries the load: 150 ms more prefill than a's.
    assert (b.predicted_prefill_ms or 0) - (a.predicted_prefill_ms or 0) == 150.0
    # A queue on a predicted to take longer than the load: b loads it.
    assert _decide(queued_on_holder=20_000).worker_id == "b"


def test_a_request_of_the_base_model_ignores_adapters() -> None:
    base = _decide(queued_on_holder=0, request=dataclasses.replace(REQUEST, lora=None))
    assert all(c.lora_resident is None for c in base.candidates)
    assert base.candidates[0].predicted_prefill_ms == base.candidates[1].predicted_prefill_ms


def test_a_replay_decides_an_adapters_request_again_from_its_record() -> None:
    decision = _decide(queued_on_holder=0)
    spec = SPEC.model_copy(update={"lora": "lora-3"})
    event = RouteDecided(source="planner/x", request_id="r1", spec=spec, **decision.route_fields())
    decoded = codec.decode_event(codec.encode(event))
    assert isinstance(decoded, RouteDecided)
    inputs = inputs_of(decoded)
    assert inputs.request.lora == "lora-3"
    assert [v.loras for v in inputs.decoders] == [frozenset({"lora-3"}), frozenset()]
    policy = KvAware(KvSettings(lora_load_ms=150.0))
    assert differences(decoded, redecide(decoded, policy, NEVER)) == []
