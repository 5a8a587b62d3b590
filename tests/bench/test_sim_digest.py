"""The replay fingerprint: the same for the same replay, another for a token gap's last digits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.sim_digest import digest, main
from infra.bench.offline import OfflineReplay
from infra.bench.traces import load_trace
from services.engine.sim import SimConfig
from services.planner.policy_registry import make_policy


def test_digest_sees_every_gap_and_not_the_wall(small_trace: Path) -> None:
    def replay() -> str:
        trace = load_trace(small_trace)
        result = OfflineReplay(trace, make_policy("kv", 0), 2, SimConfig()).run()
        return digest(result)

    first = replay()
    assert replay() == first  # its wall time differs; nothing else
    trace = load_trace(small_trace)
    result = OfflineReplay(trace, make_policy("kv", 0), 2, SimConfig()).run()
    gaps = result.records[3].times.gaps_ms
    gaps[-1] = gaps[-1] + gaps[-1] * 2.0**-50  # its last digits
    assert digest(result) != first


def test_main_prints_one_line(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", str(small_trace), "--workers", "2", "--output-length", "oracle"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert len(line["digest"]) == 16
    assert line["kv_moves"] == 0
