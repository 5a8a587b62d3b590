"""A short live replay through the real services, and `laneway bench` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra.bench.live_replay import replay_live
from infra.bench.traces import load_trace
from tests.live import ClusterFactory

pytestmark = pytest.mark.live  # every test here starts services or `laneway` itself


async def test_live_replay_completes_every_request(
    small_trace: Path, cluster_factory: ClusterFactory
) -> None:
    trace = load_trace(small_trace, speedup=20)
    cluster = cluster_factory(
        workers=2,
        policy="round_robin",
        env={"LANEWAY_BLOCK_SIZE": "64", "LANEWAY_NUM_GPU_BLOCKS": "2048"},
    )
    finished: list[int] = []
    result = await replay_live(
        trace,
        cluster.config.base_url,
        cluster.nats_url,
        "laneway-sim",
        block_size=64,
        progress=finished.append,
        headers=cluster.api_headers,
    )
    report = result.report
    assert finished == list(range(13))  # the progress callback: the start, each finished request
    assert report["completed"] == len(trace) == 12
    assert report["failed"] == 0 and report["client_errors"] == {}
    assert sum(report["worker_requests"].values()) == 12
    assert len(report["worker_requests"]) == 2
    assert 0 < report["prefix_hit_rate"] < 1
    assert all(
        r.output_tokens == t.output_length for r, t in zip(result.records, trace, strict=True)
    )
    assert report["ttft_ms"]["p50"] > 0
    # Gaps at the client include the trip from the worker; at the worker they do not, and the
    # fixed-perf-model workers decode a step in 1 ms (paced on a busy machine, so give it room).
    assert 0 < report["worker_itl_ms"]["p50"] <= report["itl_ms"]["p95"]
    assert report["worker_itl_ms"]["p50"] < 50
    # Every token came in some chunk, and no chunk came empty.
    assert report["tokens_per_chunk"] >= 1


def test_bench_command_writes_table_json_and_plot(small_trace: Path, tmp_path: Path) -> None:
    # In folders not made yet, as the README's /tmp/laneway/… may be.
    made_later = tmp_path / "not" / "made"
    out, png, why = made_later / "bench.json", made_later / "bench.png", tmp_path / "why.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "bench",
            "--trace",
            str(small_trace),
            "--policy",
            "round_robin",
            "--policy",
            "kv",
            "--workers",
            "2",
            "--num-gpu-blocks",
            "2048",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--decisions",
            str(why),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "round_robin" in run.stdout and "kv" in run.stdout
    reports = json.loads(out.read_text())
    assert set(reports) == {"round_robin", "kv"}
    decisions = [json.loads(line) for line in why.read_text().splitlines()]
    kv = [d for d in decisions if d["policy"] == "kv"]
    assert len(kv) == 12
    assert all(len(d["candidates"]) == 2 and d["reason"] for d in kv)
    assert all(c["predicted_prefill_ms"] is not None for c in kv[0]["candidates"])
    assert reports["round_robin"]["completed"] == 12
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_a_trace_says_so(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "infra.cli", "bench", "--trace", str(tmp_path / "none.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    assert "no trace" in run.stderr


def test_bench_disaggregated_with_autoscale(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    run = subprocess.run(
        [
            sys.executable, "-m", "infra.cli", "bench", "--trace", str(small_trace),
            "--policy", "kv", "--workers", "3", "--prefill-workers", "1", "--autoscale",
            "--plan-interval-s", "1", "--num-gpu-blocks", "2048", "--json", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())["kv"]
    assert report["completed"] == 12
    assert report["roles_timeline"][0] == {"t": 0.0, "prefill": 1, "decode": 2, "reason": "start"}
    assert set(report["pool_busy_fraction"]) == {"prefill", "decode"}


def test_live_bench_with_a_prefill_pool(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "live-disagg.json"
    run = subprocess.run(
        [
            sys.executable, "-m", "infra.cli", "bench", "--trace", str(small_trace),
            "--mode", "live", "--time-scale", "10", "--policy", "kv", "--workers", "3",
            "--prefill-workers", "1", "--disagg", "always", "--num-gpu-blocks", "4096",
            "--json", str(out),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())["kv"]
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["remote_prefills"] == 12
    assert set(report["pool_busy_fraction"]) == {"prefill", "decode"}
    assert report["pool_busy_fraction"]["prefill"] > 0


def test_live_bench_with_host_tiers_and_predicted_lengths(
    small_trace: Path, tmp_path: Path
) -> None:
    out = tmp_path / "live-tiers.json"
    bench = [
        sys.executable, "-m", "infra.cli", "bench", "--trace", str(small_trace), "--mode", "live",
        "--time-scale", "10", "--policy", "kv", "--workers", "2",
    ]  # fmt: skip
    run = subprocess.run(
        [*bench, "--num-gpu-blocks", "512", "--host-kv-ratio", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())["kv"]
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["kv_tiers"]["host_kv_ratio"] == 2.0
    assert report["kv_tiers"]["output_length"] == "predicted"
    # What live workers cannot be told is refused before anything starts.
    for offline_only in (["--topology", "1x2"], ["--output-length", "max-tokens", "8"]):
        refused = subprocess.run(
            [*bench, *offline_only], capture_output=True, text=True, timeout=60, check=False
        )
        assert refused.returncode == 2 and "offline only" in refused.stderr
