"""The live planner with the host tier, KV moves and the output-length predictor: what the
overlap answer, the registrations and the finished requests tell it reaches the one decision,
and the published decision can be made again from its event and the recorded settings."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import (
    Event,
    RequestAccepted,
    RequestFinished,
    RequestSpec,
    RouteDecided,
    SamplingParams,
    Usage,
    WorkerLoadReported,
    utc_now,
)
from schemas.messages import OverlapQueries, OverlapReplies, OverlapReply
from services.planner.disagg import DisaggSettings
from services.planner.handlers import Planner
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.main import PlannerSettings
from services.planner.output_length import OutputLengthPredictor
from services.planner.replay import configured, differences, redecide, settings_of
from tests.helpers import eventually, registration

BLOCKS = 512
HASHES = tuple(range(BLOCKS))
NEVER = DisaggSettings(mode="never")


def _finished(request_id: str, completion_tokens: int, worker_id: str = "a") -> RequestFinished:
    return RequestFinished(
        source="test",
        request_id=request_id,
        session_id="s",
        worker_id=worker_id,
        finish_reason="stop",
        usage=Usage(prompt_tokens=BLOCKS * 16, completion_tokens=completion_tokens),
        ttft_ms=1.0,
        e2e_ms=2.0,
    )


def _accepted() -> RequestAccepted:
    spec = RequestSpec(
        model="m",
        prompt_token_ids=(1,) * (BLOCKS * 16),
        block_size=16,
        block_hashes=HASHES,
        sampling=SamplingParams(max_tokens=100),
        reply_to="tiers-reply",
        deadline=utc_now() + timedelta(minutes=5),
        priority="high",
    )
    return RequestAccepted(source="test", request_id="r-tiers", session_id="s", spec=spec)


async def test_host_runs_places_and_learned_lengths_reach_the_decision(bus: Bus) -> None:
    settings = KvSettings(moves=True)
    planner = Planner(
        bus, KvAware(settings), "tiers", overlap_timeout_s=2.0, lengths=OutputLengthPredictor()
    )
    place = {"node": "n0", "rack": "r0", "kv_blocks_total": 4096, "kv_handoff": True}
    await planner.on_workers({w: registration(w).model_copy(update=place) for w in ("a", "b")})
    # a holds the whole prompt, 100 blocks on its GPU and the rest in its host tier, behind a
    # long queue: pulling it to the idle b over their node's link is sooner.
    busy = WorkerLoadReported(
        source="test", worker_id="a", role="both", running=4, waiting=8,
        waiting_prefill_tokens=60_000, kv_blocks_used=100, kv_blocks_total=4096,
    )  # fmt: skip
    await planner.on_load(busy)

    async def on_overlap(batch: OverlapQueries) -> OverlapReplies:
        [query] = batch.queries
        assert query.block_hashes == HASHES
        reply = OverlapReply(overlaps={"a": 100}, indexed_blocks=100, host_runs={"a": 412})
        return OverlapReplies(replies=(reply,))

    routes: list[RouteDecided] = []

    async def on_route(event: Event) -> None:
        if isinstance(event, RouteDecided):
            routes.append(event)

    await bus.serve(Subjects.overlap_queries, on_overlap, queue="tiers")
    await bus.subscribe(Subjects.all_routes, on_route)
    for n, tokens in enumerate((30, 40, 41)):
        await planner.on_terminal(_finished(f"done-{n}", tokens))
    await planner.on_request(_accepted())
    [route] = await eventually(lambda: routes)
    assert route.worker_id == "b"
    # The session's answers averaged (30 + 40 + 41) / 3, under the request's max_tokens.
    assert route.expected_output_tokens == 37
    owner = next(c for c in route.candidates if c.worker_id == "a")
    assert (owner.cached_blocks, owner.host_blocks, owner.node, owner.rack) == (
        100, 412, "n0", "r0",
    )  # fmt: skip
    move = route.kv_move
    assert move is not None and move.source_worker_id == "a"
    assert move.blocks == BLOCKS - 1  # the last token is always computed
    assert {a.action for a in move.alternatives} == {"owner", "move", "recompute"}
    # A replay re-decides it from the event (its priority too) and the planner's recorded
    # settings alone.
    recorded = configured("planner/tiers", "kv", 0, settings, NEVER, "0")
    policy, disagg = settings_of(recorded)
    assert differences(route, redecide(route, policy, disagg)) == []
    # So does a planner's record from before `kv_moves` was called `moves`.
    old = {("kv_moves" if k == "moves" else k): v for k, v in recorded.kv.items()}
    policy, disagg = settings_of(recorded.model_copy(update={"kv": old}))
    assert differences(route, redecide(route, policy, disagg)) == []
    # Its answer ends up 13 tokens longer than predicted: the predictor's error, measured.
    await planner.on_terminal(_finished("r-tiers", 50, worker_id="b"))
    registry = planner.metrics.registry
    errors = "laneway_planner_output_length_error_tokens"
    assert registry.get_sample_value(f"{errors}_count") == 1
    assert registry.get_sample_value(f"{errors}_sum") == 13


def test_the_planners_settings_carry_moves_links_and_the_host_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each knob of the kv policy is read as LANEWAY_KV_<NAME>.
    for name, value in {
        "MOVES": "1",
        "MOVE_MARGIN_MS": "20",
        "HOST_LINK_GB_S": "12.5",
        "NODE_LINK_GB_S": "150",
        "RACK_LINK_GB_S": "40",
        "CROSS_LINK_GB_S": "10",
        "SLOW_STEP_MS_PER_TOKEN": "0.5",
    }.items():
        monkeypatch.setenv(f"LANEWAY_KV_{name}", value)
    kv = PlannerSettings().kv_settings()
    assert (kv.moves, kv.move_margin_ms, kv.host_link_gb_s) == (True, 20.0, 12.5)
    assert (kv.node_link_gb_s, kv.rack_link_gb_s, kv.cross_link_gb_s) == (150.0, 40.0, 10.0)
    assert kv.slow_step_ms_per_token == 0.5
    assert PlannerSettings().output_length == "predicted"
    monkeypatch.setenv("LANEWAY_SPEEDUP", "4")
    monkeypatch.setenv("LANEWAY_KV_TTFT_TARGET_MS", "200")
    monkeypatch.setenv("LANEWAY_KV_HIGH_PRIORITY_WEIGHT", "3")
    urgent = PlannerSettings().kv_settings()
    assert (urgent.ttft_target_ms, urgent.high_priority_weight) == (800.0, 3.0)


@pytest.mark.parametrize(
    ("name", "value"), [("NODE_LINK_GB_S", "0"), ("TTFT_MISS_WEIGHT", "-1"), ("MOVES", "maybe")]
)
def test_a_knob_out_of_its_range_stops_the_planner(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"LANEWAY_KV_{name}", value)
    with pytest.raises(ValidationError, match=name.lower()):
        PlannerSettings()


@pytest.mark.parametrize(
    ("knob", "shared"),
    [
        ("ITL_TARGET_MS", "LANEWAY_ITL_TARGET_MS"),
        ("KV_BYTES_PER_TOKEN", "LANEWAY_KV_BYTES_PER_TOKEN"),
    ],
)
def test_a_knob_the_policy_shares_is_read_under_the_shared_name_only(
    knob: str, shared: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(f"LANEWAY_KV_{knob}", "7")
    with pytest.raises(ValidationError, match=f"LANEWAY_KV_{knob} is read from {shared}"):
        PlannerSettings()
    monkeypatch.delenv(f"LANEWAY_KV_{knob}")
    monkeypatch.setenv(shared, "7")
    kv = PlannerSettings().kv_settings()
    assert getattr(kv, knob.lower()) == 7
