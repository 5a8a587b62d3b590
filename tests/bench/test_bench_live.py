"""`laneway up` as a benchmark's child: known ready from its state dir (URL, key, pids), a short
load with its CPU per request, and nothing of it left running afterwards."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.bench_live import Target, loads, run_all
from benchmarks.live_cluster import laneway_up

pytestmark = pytest.mark.live  # starts laneway up


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    # A zombie is gone but for its parent's wait.
    return state != "Z"


def test_bench_live_drives_a_laneway_up_of_its_own() -> None:
    with laneway_up(workers=2, speedup=1000) as up:
        assert up.base_url.startswith("http://127.0.0.1:") and up.base_url.endswith("/v1")
        assert up.api_key and up.nats_url.startswith("nats://")
        assert {"nats", "etcd", "ingress", "planner", "kv-indexer"} <= set(up.pids)
        assert sum(name.startswith("decode-worker-") for name in up.pids) == 2
        assert (up.logs / "ingress.log").exists()
        pids = tuple(up.pids.values())
        target = Target("laneway", up.base_url, up.api_key, pids)
        shape = loads(seq_requests=5, duration_s=1.0)
        results = asyncio.run(run_all([target], {"seq": shape["seq"], "c32": shape["c32"]}, 1))
    assert [r["load"] for r in results] == ["seq", "c32"]
    assert all(r["errors"] == 0 and r["ok"] >= 5 for r in results)
    assert all(r["mean_completion_tokens"] == 8 and r["ttft_without_text"] == 0 for r in results)
    assert all(0 < r["cpu_ms_per_request"] < 1000 for r in results)
    assert not [pid for pid in pids if _alive(pid)]
