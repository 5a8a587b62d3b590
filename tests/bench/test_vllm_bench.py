"""`laneway bench --mode live --engine vllm` end to end on a few requests: two vLLM workers over
`laneway make-tiny-model`'s checkpoint, token-id prompts made of the trace's block ids, and a
report whose cached tokens are vLLM's own count, the same the planner's index routed on. Behind
``-m slow``: the workers take 15-40 s to load on 2 cores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from infra.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.live]


def test_a_live_vllm_replay_reports_vllms_cached_tokens(
    small_trace: Path, made_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench", "--trace", str(small_trace), "--mode", "live", "--engine", "vllm",
        "--model", str(made_model), "--workers", "2", "--policy", "kv",
        "--max-output-tokens", "8", "--kv-cache-gib", "0.0625", "--json", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())["kv"]
    assert report["engine"] == "vllm"
    assert report["completed"] == report["requests"] == 12 and report["client_errors"] == {}
    for key, stat in [("ttft_ms", "p50"), ("ttft_ms", "p95"), ("itl_ms", "p50"),
                      ("itl_ms", "p95"), ("e2e_ms", "p95")]:  # fmt: skip
        assert math.isfinite(report[key][stat]) and report[key][stat] > 0, (key, stat)
    # 32 tokens per block id: each turn's prompt a sixteenth of the trace's.
    assert report["prompt_tokens"] == sum(-(-n // 16) for n in _input_lengths(small_trace))
    # Each turn extends its conversation's last prompt, 2 s later: vLLM finds it cached where
    # the planner's index, fed by vLLM's KV events, said it would be.
    assert 0 < report["cached_tokens"] <= report["index_cached_tokens"]
    assert report["prefix_hit_rate"] == report["cached_tokens"] / report["prompt_tokens"]


def _input_lengths(trace: Path) -> list[int]:
    return [json.loads(line)["input_length"] for line in trace.read_text().splitlines()]
