"""Offline replays with KV beyond one worker: a host tier, KV moves on a topology, and the
output length the planner is told; and the bench flags that set them."""

from __future__ import annotations

import json
from pathlib import Path

from infra.bench.offline import OfflineReplay
from infra.bench.tiers import TierSettings
from infra.bench.traces import TraceRequest
from infra.cli import main
from services.engine.sim import SimConfig
from services.planner.kv_policy import KvAware, KvSettings


def _conversation_burst() -> list[TraceRequest]:
    """One 20-block prompt, then a burst of eight turns extending it, 10 ms apart."""
    head = tuple(range(20))
    trace = [TraceRequest(0.0, 20 * 512, 8, head, 0)]
    for k in range(1, 9):
        ids = (*head, 100 + k)
        trace.append(TraceRequest(1.0 + k * 0.01, len(ids) * 512, 8, ids, k))
    return trace


def _run(trace: list[TraceRequest], moves: bool) -> OfflineReplay:
    policy = KvAware(KvSettings(moves=moves))
    tiers = TierSettings(topology=(1, 4), output_length="oracle")
    replay = OfflineReplay(trace, policy, 4, SimConfig(block_size=64), tiers=tiers)
    replay.decisions = []
    return replay


def test_a_burst_on_one_owner_moves_its_kv_to_idle_workers_and_says_why() -> None:
    moving = _run(_conversation_burst(), moves=True)
    with_moves = moving.run()
    without = _run(_conversation_burst(), moves=False).run().report
    assert with_moves.report["kv_moves"] > 0
    explained = [d for d in with_moves.decisions if d["kv_move"] is not None]
    assert len(explained) == with_moves.report["kv_moves"]
    for d in explained:
        actions = [a["action"] for a in d["kv_move"]["alternatives"]]
        assert actions == ["owner", "move", "recompute"]
        assert d["kv_move"]["source_worker_id"] != d["worker_id"]
    # The moved turns find the head cached where they run instead of recomputing it.
    assert with_moves.report["prefix_hit_rate"] > without["prefix_hit_rate"]
    assert with_moves.report["ttft_ms"]["mean"] < without["ttft_ms"]["mean"]


def test_a_host_tier_keeps_what_the_gpu_evicts() -> None:
    # Two conversations take turns on a GPU that holds one of them: each turn evicts the other.
    trace: list[TraceRequest] = []
    for turn in range(6):
        for conv in range(2):
            ids = tuple(range(conv * 100, conv * 100 + 10 + turn))
            trace.append(TraceRequest(turn * 2.0 + conv, len(ids) * 512, 4, ids, len(trace)))

    def hit_rate(host_blocks: int) -> float:
        config = SimConfig(block_size=64, num_gpu_blocks=120, num_host_blocks=host_blocks)
        replay = OfflineReplay(trace, KvAware(), 1, config)
        return float(replay.run().report["prefix_hit_rate"])

    assert hit_rate(0) < 0.2
    assert hit_rate(480) > 0.7


def test_the_bench_flags_are_in_the_report(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--trace", str(small_trace), "--policy", "kv", "--workers", "4"]
    flags = ["--host-kv-ratio", "2", "--host-link-gb-s", "12.5", "--topology", "2x2"]
    lengths = ["--output-length", "max-tokens", "64"]
    assert main([*args, *flags, *lengths, "--num-gpu-blocks", "2048", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["kv"]
    assert report["kv_tiers"] == {
        "host_kv_ratio": 2.0,
        "host_link_gb_s": 12.5,
        "topology": "2x2",
        "output_length": "max-tokens",
        "max_tokens": 64,
    }
    assert report["output_length"]["mode"] == "max-tokens"
    # Prefill workers are placed too (first), and their hand-offs cross the topology's links.
    split = [*args, "--prefill-workers", "2", "--topology", "2x2", "--num-gpu-blocks", "2048"]
    assert main([*split, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kv"]["completed"] == 12
    assert main([*args, "--topology", "3x2"]) == 2
    assert main([*args, "--output-length", "max-tokens"]) == 2


def test_predicted_lengths_are_learned_and_their_error_reported() -> None:
    replay = OfflineReplay(
        [TraceRequest(t * 1.0, 1024, 10 + 10 * (t % 2), (t, 100 + t), t) for t in range(20)],
        KvAware(),
        1,
        SimConfig(block_size=64, num_gpu_blocks=2048),
        tiers=TierSettings(output_length="predicted"),
    )
    replay.decisions = []
    result = replay.run()
    errors = result.report["output_length"]
    assert errors["predicted_requests"] == 20
    # Answers of 10 and 20 tokens in turn: once learned, about 15 is off by about 5.
    assert 4 <= errors["mean_abs_error_tokens"] <= 60
    expected = [d["expected_output_tokens"] for d in result.decisions]
    assert expected[0] == 256  # the prior: nothing had finished
    assert all(10 <= e <= 20 for e in expected[2:])


def test_a_kv_knob_reaches_the_policy_and_the_report(small_trace: Path, tmp_path: Path) -> None:
    """``--kv NAME=VALUE`` sets the knob the live planner reads from LANEWAY_KV_<NAME>: with a
    temperature every choice is drawn, and says so in its decision."""
    out, decisions = tmp_path / "bench.json", tmp_path / "decisions.jsonl"
    args = ["bench", "--trace", str(small_trace), "--policy", "kv", "--workers", "4"]
    knob = ["--kv", "temperature=50", "--kv", "max_num_batched_tokens=4096"]
    assert main([*args, *knob, "--json", str(out), "--decisions", str(decisions)]) == 0
    report = json.loads(out.read_text())["kv"]
    assert report["kv_knobs"] == {"temperature": 50.0, "max_num_batched_tokens": 4096}
    reasons = {json.loads(line)["reason"] for line in decisions.read_text().splitlines()}
    assert {r.split(":")[0] for r in reasons} == {"softmax over predicted TTFT"}
