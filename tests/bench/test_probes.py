"""The acceptance probes, small: each runs a cluster of its own and reports what it promises."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import probe_itl, probe_streams
from benchmarks.cluster_gauges import kept, loop_late, rates

pytestmark = pytest.mark.live  # each starts a cluster


def test_streams_probe_reports_streams_probes_memory_and_logs(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    argv = ["--streams", "20", "--max-tokens", "100", "--speedup", "1", "--duration", "8"]
    argv += ["--steady", "4"]
    argv += ["--ramp", "1", "--probe-every", "1", "--state-dir", str(tmp_path / "state")]
    argv += ["--worker-nice", "5"]
    assert probe_streams.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["opened"] == r["first_event"] == r["finished"] == 20
    assert r["cut"] == 0 and not r["broken"] and not r["error_events"] and not r["refused"]
    probes = r["probe_ttft_ms"]
    assert probes["n"] >= 2 and probes["answered"] == probes["n"] and probes["errors"] == 0
    assert 0 < probes["p50"] < 5000
    # Probed from the start, and after the ramp (every stream open) apart.
    assert probes["all"][0]["t"] < r["ramp_s"] and 1 <= probes["steady"]["n"] < probes["n"]
    assert r["rss_peak_mb"]["nats"] > 5 and r["rss_peak_mb"]["ingress"] > 20
    cpu = r["ingress_cpu"]
    assert 0 < cpu["share"] < 2 and cpu["us_per_event"] > 0 and cpu["writes_per_event"] > 0
    procs = r["steady_processes"]
    assert {"ingress", "planner", "nats", "load-client"} <= procs.keys()
    assert procs["ingress"]["cpu"] > 0 and all(p["waiting"] >= 0 for p in procs.values())
    late = r["ingress_loop_late"]["ingress"]
    assert late is not None and late["mean_ms"] >= 0 and 0 <= late["busy_share"] <= 1
    assert r["rss_timeline_mb"] and r["log_signs"] == {}
    # Where requests wait and how fast the workers really stepped, from their /metrics.
    assert all(p["ingress"]["capacity"] == 4 * 512 for p in r["gauges"][1:])
    assert len(r["worker_rates"]) == 4
    assert sorted(r["worker_niceness"].values()) == [5] * 4
    assert all(w["tokens_per_s"] > 0 and w["steps_per_s"] > 0 for w in r["worker_rates"].values())
    assert r["state_dir"] == str(tmp_path / "state")
    assert (tmp_path / "state" / "logs" / "ingress.log").exists()


def test_itl_probe_sets_the_clients_gaps_beside_the_workers(
    small_trace: Path, tmp_path: Path
) -> None:
    out = tmp_path / "itl.json"
    argv = ["--trace", str(small_trace), "--limit", "6", "--time-scale", "20", "--workers", "2"]
    assert probe_itl.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0 and r["client_errors"] == {}
    client, worker = r["client_itl_ms"], r["worker_itl_ms"]
    assert 0 < worker["p50"] <= worker["p95"] and 0 < client["p50"] <= client["p95"]
    assert r["p95_ratio"] == pytest.approx(client["p95"] / worker["p95"])
    assert r["tokens_per_chunk"] >= 1


def test_stream_figures_keep_counted_kinds() -> None:
    stats = probe_streams.StreamStats(opened=3)
    stats.refused["HTTP 429"] += 2
    figures = stats.figures()
    assert figures["opened"] == 3 and figures["refused"] == {"HTTP 429": 2}
    assert json.loads(json.dumps(figures))["refused"] == {"HTTP 429": 2}


def test_gauges_keep_the_queues_and_rate_the_workers() -> None:
    text = (
        "# HELP laneway_worker_running x\nlaneway_worker_running 3.0\n"
        'laneway_worker_tokens_total{kind="generated"} 100.0\n'
        'laneway_worker_tokens_total{kind="prefill"} 7.0\n'
        "laneway_worker_busy_seconds_total 1.0\nlaneway_worker_step_seconds_count 10.0\n"
    )
    start = kept("decode-worker-0", text)
    assert start == {"running": 3.0, "generated": 100.0, "busy_s": 1.0, "steps": 10.0}
    assert kept("ingress", "laneway_ingress_admission_queue_depth 2.0\n") == {
        "admission_queue": 2.0
    }
    end = {**start, "generated": 300.0, "busy_s": 2.5, "steps": 30.0}
    timeline = [{"t": 0.0, "decode-worker-0": start}, {"t": 2.0, "decode-worker-0": end}]
    assert rates(timeline) == {
        "decode-worker-0": {"tokens_per_s": 100.0, "steps_per_s": 10.0, "busy_share": 0.75}
    }


def test_probe_figures_count_the_unanswered_as_at_least_their_wait() -> None:
    probes = [
        {"t": 10.0, "ttft_ms": 300.0, "error": None},
        {"t": 12.0, "ttft_ms": None, "error": "HTTP 429: busy"},
        {"t": 14.0, "ttft_ms": 900.0, "error": None},
        {"t": 16.0, "ttft_ms": None, "error": "unanswered", "waited_ms": 10_000.0},
    ]
    figures = probe_streams.probe_figures(probes, steady_from=13.0)
    assert figures["steady"]["n"] == 2 and figures["steady"]["answered"] == 1
    assert figures["steady"]["max"] == 10_000.0 and "all" not in figures["steady"]
    assert figures["n"] == 4 and figures["answered"] == 2 and figures["unanswered"] == 1
    assert figures["errors"] == 2 and figures["over_1s"] == 1
    assert figures["max"] == 10_000.0 and 300 <= figures["p50"] <= 900
    assert figures["error_kinds"] == {"HTTP 429: busy": 1, "unanswered": 1}


def test_loop_lateness_is_taken_from_the_sample_before_the_window() -> None:
    def at(t: float, late_s: float, ticks: float, under: float) -> dict[str, Any]:
        return {"t": t, "ingress": {"late_s": late_s, "ticks": ticks, "ticks_under_busy": under}}

    timeline = [at(0.0, 0.0, 0, 0), at(5.0, 1.0, 100, 100), at(10.0, 31.0, 200, 150)]
    # From the sample at 5 s: 100 ticks, 30 s late in all, 50 of them over 0.2 s late.
    assert loop_late(timeline, since=7.0) == {"mean_ms": 300.0, "busy_share": 0.5}
    assert loop_late(timeline) == {"mean_ms": 155.0, "busy_share": 0.25}
    assert loop_late(timeline[:1]) is None and loop_late([{"t": 0.0, "ingress": "down"}]) is None
