"""One recorded routing decision, made by the live code and read back through the wire: what
the replay tests decide again and the record bench measures."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas import codec
from schemas.events import RequestSpec, RouteDecided, SamplingParams, StepCost
from services.planner.decision import DecisionInputs, decide
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvAware
from services.planner.policy import RouteRequest, WorkerView

DISAGG = DisaggSettings(mode="auto", min_remote_tokens=64)
SPEC = RequestSpec(
    model="m",
    prompt_token_ids=(1,) * 1000,
    block_size=16,
    block_hashes=tuple(range(62)),
    sampling=SamplingParams(max_tokens=40),
    reply_to="i",
    deadline=datetime(2030, 1, 1, tzinfo=UTC),
)
MEASURED = StepCost(
    prefill_step_ms=2.5, prefill_ms_per_token=0.07, decode_step_ms=9.0, decode_ms_per_seq=0.4
)


def decision_inputs() -> DecisionInputs:
    def view(
        worker_id: str, running: int, cached: int = 0, queued: int = 0, cost: StepCost | None = None
    ) -> WorkerView:
        return WorkerView(
            worker_id,
            running=running,
            waiting=1,
            kv_usage=0.25,
            in_flight=running + 1,
            cached_blocks=cached,
            waiting_prefill_tokens=queued,
            block_size=16,
            kv_capacity_tokens=16_384,
            step_cost=cost,
        )

    return DecisionInputs(
        RouteRequest("r1", 1000, SPEC.block_hashes, max_tokens=40),
        # b measured its own steps (a real engine); a and p are predicted with the perf model.
        [view("a", 3, cached=30), view("b", 0, queued=2000, cost=MEASURED)],
        [view("p", 0, cached=10)],
        frozenset({"a", "b", "p"}),
    )


def recorded(policy: KvAware) -> RouteDecided:
    policy.turn = 7  # as if the planner had made seven decisions before this one
    decision = decide(policy, DISAGG, decision_inputs())
    event = RouteDecided(source="planner/x", request_id="r1", spec=SPEC, **decision.route_fields())
    # Through the wire, as a replayer reads it back.
    decoded = codec.decode_event(codec.encode(event))
    assert isinstance(decoded, RouteDecided)
    return decoded
