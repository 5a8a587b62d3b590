"""KV beyond one worker's GPU: host-tier hits in the kv policy's cost, the link model between
workers, and the one decision's choice to move KV, explained in what RouteDecided carries."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.kv_transfer import KvTransferModel, LinkModel
from services.planner.decision import Decision, DecisionInputs, decide
from services.planner.disagg import DisaggSettings, plan_prefill
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.policy import RouteRequest, WorkerView

BLOCKS = 512  # 8,192 tokens at block size 16


def request(expected: int | None = None) -> RouteRequest:
    return RouteRequest("r", BLOCKS * 16, tuple(range(BLOCKS)), None, 100, expected)


def view(worker_id: str, **kwargs: object) -> WorkerView:
    base = WorkerView(worker_id, running=0, waiting=0, kv_usage=0.0, in_flight=0, node="n0")
    return dataclasses.replace(base, **kwargs)  # type: ignore[arg-type]


def test_the_link_depends_on_where_the_two_workers_are() -> None:
    links = LinkModel()
    assert links.between(("n0", "r0"), ("n0", "r0")) is links.same_node
    assert links.between(("n0", "r0"), ("n1", "r0")) is links.same_rack
    assert links.between(("n0", "r0"), ("n1", "r1")) is links.across_racks
    # Unknown places share nothing: the slowest link.
    assert links.between(("", ""), ("", "")) is links.across_racks
    # 8,192 tokens of 128 KiB: 1 GiB, about 3.6 ms over NVLink-class and 43 ms over RDMA-class.
    assert abs(links.same_node.transfer_ms(8192) - (0.05 + 8192 * 131_072 / 300e6)) < 1e-9
    assert links.across_racks.transfer_ms(8192) > 10 * links.same_node.transfer_ms(8192)


def test_a_host_tier_hit_costs_the_pcie_load_not_a_prefill() -> None:
    policy = KvAware(KvSettings(host_link_gb_s=25.0))
    gpu = policy.predict(request(), view("a", cached_blocks=BLOCKS - 1))
    host = policy.predict(request(), view("a", cached_blocks=10, host_blocks=BLOCKS - 11))
    cold = policy.predict(request(), view("a"))
    load = KvTransferModel(bandwidth_gb_s=25.0, latency_ms=0.05).transfer_ms((BLOCKS - 11) * 16)
    assert abs(host.prefill_ms - gpu.prefill_ms - load) < 1e-6
    assert host.cost < cold.cost


def test_a_move_and_a_host_load_carry_the_kv_size_the_worker_declares() -> None:
    policy = KvAware(KvSettings(moves=True))
    source = view("a", cached_blocks=BLOCKS - 1)
    # A model whose token's KV takes 4 KiB, as its engine declares, not the configured 128 KiB.
    small = view("b", kv_bytes_per_token=4096)
    moved = policy.predict(request(), small, source)
    tokens = (BLOCKS - 1) * 16
    assert moved.move_ms == pytest.approx(0.05 + tokens * 4096 / 300e6)
    assert policy.predict(request(), view("b"), source).move_ms > 20 * moved.move_ms
    # A host-tier load of the same blocks: PCIe at the declared size too.
    gpu = policy.predict(request(), view("a", cached_blocks=BLOCKS - 1, kv_bytes_per_token=4096))
    host = policy.predict(
        request(), view("a", cached_blocks=10, host_blocks=BLOCKS - 11, kv_bytes_per_token=4096)
    )
    load = KvTransferModel(4096, 25.0, 0.05).transfer_ms((BLOCKS - 11) * 16)
    assert host.prefill_ms - gpu.prefill_ms == pytest.approx(load)


def _decide(
    settings: KvSettings,
    owner: WorkerView,
    others: list[WorkerView],
    handoff: frozenset[str] | None = None,
) -> Decision:
    """``handoff`` None: every worker can send and take KV."""
    workers = [owner, *others]
    able = frozenset(w.worker_id for w in workers) if handoff is None else handoff
    inputs = DecisionInputs(request(), workers, handoff=able)
    return decide(KvAware(settings), DisaggSettings(mode="never"), inputs)


def test_a_busy_owners_kv_is_moved_to_an_idle_worker_and_the_move_explained() -> None:
    owner = view("a", cached_blocks=BLOCKS, waiting_prefill_tokens=60_000, running=20)
    idle = view("b")
    moved = _decide(KvSettings(moves=True), owner, [idle])
    assert moved.worker_id == "b"
    move = moved.kv_move
    assert move is not None and move.source_worker_id == "a"
    assert move.blocks == BLOCKS - 1  # the last token is always computed
    ttft = {a.action: a.predicted_ttft_ms for a in move.alternatives}
    assert set(ttft) == {"owner", "move", "recompute"}
    assert ttft["move"] < min(ttft["owner"], ttft["recompute"])
    assert ttft["move"] >= move.transfer_ms
    assert "pulled from a" in moved.reason
    # The event's fields carry the move; the prompt queues on b less what it is sent.
    assert moved.route_fields()["kv_move"] == move
    assert moved.queued_tokens == BLOCKS * 16 - move.blocks * 16
    # Without moves, the same cluster recomputes on b: later.
    recomputed = _decide(KvSettings(), owner, [idle])
    assert recomputed.worker_id == "b" and recomputed.kv_move is None


def test_no_move_from_or_to_a_worker_whose_engine_cannot_hand_kv_over() -> None:
    owner = view("a", cached_blocks=BLOCKS, waiting_prefill_tokens=60_000, running=20)
    assert _decide(KvSettings(moves=True), owner, [view("b")]).kv_move is not None
    for able in ({"a"}, {"b"}):
        moved = _decide(KvSettings(moves=True), owner, [view("b")], frozenset(able))
        assert moved.worker_id == "b" and moved.kv_move is None, able


def test_no_move_when_the_owner_is_free_or_the_link_too_slow() -> None:
    owner = view("a", cached_blocks=BLOCKS)
    assert _decide(KvSettings(moves=True), owner, [view("b")]).kv_move is None
    # A busy owner across a slow link: recomputing on b beats moving 1 GiB at 0.1 GB/s.
    busy = dataclasses.replace(owner, waiting_prefill_tokens=60_000, node="n1")
    slow = KvSettings(moves=True, rack_link_gb_s=0.1, cross_link_gb_s=0.1)
    decision = _decide(slow, busy, [view("b")])
    assert decision.worker_id == "b" and decision.kv_move is None


def test_a_hand_off_crosses_the_link_between_the_two_workers() -> None:
    # The configured link (for workers that do not say where they are) is a slow one.
    policy = KvAware()
    settings = DisaggSettings(mode="auto", transfer=KvTransferModel(bandwidth_gb_s=5.0))
    decode = view("d", waiting_prefill_tokens=60_000, running=10)
    near = plan_prefill(policy, request(), decode, [view("p")], settings)
    far = plan_prefill(policy, request(), decode, [view("p", node="n1")], settings)
    unknown = plan_prefill(policy, request(), decode, [view("p", node="")], settings)
    assert near.remote_ms is not None and far.remote_ms is not None
    links, tokens = LinkModel(), BLOCKS * 16
    expected = links.across_racks.transfer_ms(tokens) - links.same_node.transfer_ms(tokens)
    assert abs((far.remote_ms - near.remote_ms) - expected) < 1e-6
    slow = settings.transfer.transfer_ms(tokens) - links.same_node.transfer_ms(tokens)
    assert unknown.remote_ms is not None
    assert abs((unknown.remote_ms - near.remote_ms) - slow) < 1e-6
