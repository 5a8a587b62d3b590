"""Conditional disaggregation: the decision, and the prefill-to-decode hand-off offline."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from infra.bench.offline import OfflineReplay
from infra.bench.traces import load_trace
from schemas.events import SamplingParams, StructuredOutput
from services.common.kv_transfer import KvTransferModel
from services.engine.sim import SimConfig
from services.planner.decision import DecisionInputs, decide, inputs_of
from services.planner.disagg import (
    DisaggSettings,
    handoff_link,
    handoff_ms_per_token,
    plan_prefill,
)
from services.planner.kv_policy import KvAware
from services.planner.policy import RouteRequest, WorkerView
from tests.helpers import routed
from tests.ingress.helpers import request_spec

SMALL = SimConfig(block_size=64, num_gpu_blocks=2048)


def view(worker_id: str, **kwargs: object) -> WorkerView:
    base = WorkerView(worker_id, running=0, waiting=0, kv_usage=0.0, in_flight=0, block_size=64)
    return dataclasses.replace(base, **kwargs)  # type: ignore[arg-type]


def long_request(tokens: int = 32_000) -> RouteRequest:
    return RouteRequest("r", tokens, tuple(range(tokens // 64)), max_tokens=200)


def test_transfer_time_follows_bytes_and_link() -> None:
    link = KvTransferModel(kv_bytes_per_token=1000, bandwidth_gb_s=1.0, latency_ms=2.0)
    assert link.transfer_ms(0) == 0
    assert link.transfer_ms(1000) == pytest.approx(2.0 + 1.0)


def test_a_long_prompt_on_a_busy_decoder_goes_remote() -> None:
    busy = view("d", running=60)
    plan = plan_prefill(KvAware(), long_request(), busy, [view("p")], DisaggSettings())
    assert plan.prefill_worker == "p"
    assert plan.remote_ms is not None and plan.remote_ms < plan.local_ms


def test_short_or_cached_prompts_stay_local() -> None:
    settings = DisaggSettings(min_remote_tokens=1024)
    short = plan_prefill(KvAware(), long_request(512), view("d"), [view("p")], settings)
    assert short.prefill_worker is None
    cached = view("d", running=60, cached_blocks=499)
    assert (
        plan_prefill(KvAware(), long_request(), cached, [view("p")], settings).prefill_worker
        is None
    )


def test_a_backed_up_prefill_pool_keeps_prefill_local() -> None:
    swamped = view("p", waiting_prefill_tokens=2_000_000)
    plan = plan_prefill(
        KvAware(), long_request(), view("d", running=2), [swamped], DisaggSettings()
    )
    assert plan.prefill_worker is None


@pytest.mark.parametrize("mode", ["always", "auto", "never"])
def test_handed_off_requests_complete_with_every_token(small_trace: Path, mode: str) -> None:
    trace = load_trace(small_trace, speedup=4)
    replay = OfflineReplay(
        trace,
        KvAware(),
        2,
        SMALL,
        prefill_workers=1,
        disagg=DisaggSettings(mode=mode, min_remote_tokens=0),  # type: ignore[arg-type]
    )
    result = replay.run()
    report = result.report
    assert report["completed"] == len(trace)
    assert [r.output_tokens for r in result.records] == [t.output_length for t in trace]
    remote = report["remote_prefills"]
    if mode == "always":
        assert remote == sum(1 for t in trace if t.output_length > 1)
    elif mode == "never":
        assert remote == 0
    assert set(report["pool_busy_fraction"]) == {"prefill", "decode"}
    # Requests that moved keep their prefix hits on the decode side for the next turn.
    assert report["prefix_hit_rate"] > 0


def test_autoscale_moves_workers_a_step_at_a_time(small_trace: Path) -> None:
    from services.planner.capacity import CapacitySettings

    trace = load_trace(small_trace, speedup=20)
    replay = OfflineReplay(
        trace,
        KvAware(),
        3,
        SMALL,
        prefill_workers=1,
        disagg=DisaggSettings(mode="always"),
        # Targets nobody meets, first tokens all from the prefill pool: it wants more of it.
        autoscale=CapacitySettings(ttft_target_ms=1, itl_target_ms=1000, interval_s=0.5),
    )
    report = replay.run().report
    timeline = report["roles_timeline"]
    assert timeline[0]["reason"] == "start"
    assert (timeline[0]["prefill"], timeline[0]["decode"]) == (1, 3)
    assert report["completed"] == len(trace)
    pools = [(t["prefill"], t["decode"]) for t in timeline]
    assert any(p > 1 for p, _ in pools)  # it moved decoders to prefill
    assert all(d >= 1 for _, d in pools)  # never the last decoder
    for before, after in itertools.pairwise(pools):
        assert abs(after[0] - before[0]) <= 1  # at most one worker (10% of 4, at least 1)


def test_a_short_answer_behind_a_long_transfer_prefills_locally() -> None:
    settings = DisaggSettings(max_handoff_ms_per_token=3.0, max_local_stall_tokens=8192)
    busy = view("d", running=60)
    prompt = 8000
    # 8,000 tokens of KV take about 43 ms to move: 4.8 ms a gap over 9 gaps, 0.2 over 199.
    short = RouteRequest("r", prompt, tuple(range(prompt // 64)), max_tokens=10)
    long = dataclasses.replace(short, max_tokens=200)
    plan = plan_prefill(KvAware(), short, busy, [view("p")], settings)
    assert plan.prefill_worker is None
    assert "hand-off adds" in plan.reason
    assert plan_prefill(KvAware(), long, busy, [view("p")], settings).prefill_worker == "p"
    # Past the stall bound the decode worker's running requests weigh more: remote again.
    huge = RouteRequest("r", 32_000, tuple(range(500)), max_tokens=10)
    assert plan_prefill(KvAware(), huge, busy, [view("p")], settings).prefill_worker == "p"
    off = dataclasses.replace(settings, max_handoff_ms_per_token=0)
    assert plan_prefill(KvAware(), short, busy, [view("p")], off).prefill_worker == "p"


def test_a_hand_off_is_priced_at_the_kv_size_the_workers_declare() -> None:
    # The short answer above, with the workers' engines declaring a small model's KV (4 KiB a
    # token, not the configured 128 KiB): its 8,000 tokens move in about 1 ms, not 43.
    settings = DisaggSettings(max_handoff_ms_per_token=3.0, max_local_stall_tokens=8192)
    short = RouteRequest("r", 8000, tuple(range(8000 // 64)), max_tokens=10)
    small = {"kv_bytes_per_token": 4096}
    busy, prefill = view("d", running=60, **small), view("p", **small)
    plan = plan_prefill(KvAware(), short, busy, [prefill], settings)
    assert plan.prefill_worker == "p", plan.reason
    link = handoff_link(KvAware(), settings, prefill, busy)
    assert link.kv_bytes_per_token == 4096
    assert link.transfer_ms(8000) == pytest.approx(1.0 + 8000 * 4096 / 25e6)


def test_handoff_cost_is_the_transfer_over_the_gaps() -> None:
    link = KvTransferModel(kv_bytes_per_token=1000, bandwidth_gb_s=1.0, latency_ms=2.0)
    assert handoff_ms_per_token(link, 1000, 4) == pytest.approx(3.0 / 3)
    assert handoff_ms_per_token(link, 1000, 1) == pytest.approx(3.0)


def test_a_remote_first_token_past_the_target_stays_local_when_local_is_sooner() -> None:
    """The prefill worker's queue puts the remote first token past the target; locally it is
    sooner, if still stalling the decode worker's running requests."""
    busy = view("d", running=60)
    backed_up = view("p", waiting_prefill_tokens=64_000)
    untargeted = plan_prefill(KvAware(), long_request(), busy, [backed_up], DisaggSettings())
    assert untargeted.prefill_worker == "p"  # the stall on 60 decodes outweighs the queue
    targeted = DisaggSettings(ttft_target_ms=1000)
    plan = plan_prefill(KvAware(), long_request(), busy, [backed_up], targeted)
    assert plan.prefill_worker is None and "past target" in plan.reason
    # An idle prefill worker meets the target: remote as before.
    idle = plan_prefill(KvAware(), long_request(), busy, [view("p")], targeted)
    assert idle.prefill_worker == "p"


def test_a_structured_answer_is_prefilled_where_it_decodes() -> None:
    """A response_format's grammar runs on one engine from the first token: even with
    ``--disagg always`` and a busy decoder, its prompt stays there; replayed from its event, the
    same."""
    always = DisaggSettings(mode="always", min_remote_tokens=0)
    request = long_request()
    inputs = DecisionInputs(request, [view("d", running=60)], [view("p")], frozenset({"d"}))
    assert decide(KvAware(), always, inputs).prefill_worker_id == "p"
    structured = dataclasses.replace(request, no_handoff=True)
    decision = decide(KvAware(), always, dataclasses.replace(inputs, request=structured))
    assert decision.prefill_worker_id is None and decision.worker_id == "d"
    assert decision.prefill is not None and decision.prefill.reason.endswith("response_format")
    wanted = SamplingParams(max_tokens=200, structured_output=StructuredOutput(type="json_object"))
    spec = request_spec("i").model_copy(update={"sampling": wanted})
    assert inputs_of(routed("r", "d", spec)).request.no_handoff
    assert not inputs_of(routed("r", "d", request_spec("i"))).request.no_handoff
