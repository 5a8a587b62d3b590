"""`laneway bench` reports its progress on stderr and leaves its table and JSON as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.bench.offline import OfflineReplay
from infra.bench.report import format_table, write_json
from infra.bench.tiers import TierSettings
from infra.bench.traces import load_trace
from infra.cli import main
from services.engine.sim import SimConfig
from services.planner.policy_registry import make_policy


def test_offline_bench_shows_progress_lines_off_a_terminal(
    small_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--trace", str(small_trace), "--policy", "round_robin", "--workers", "2"]
    assert main([*args, "--num-gpu-blocks", "2048", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    # capsys's stderr is no terminal: plain lines, from the first arrival to the end.
    lines = captured.err.splitlines()
    assert lines[0].startswith("policy round_robin: 0/12 (0%)")
    assert lines[-1].startswith("policy round_robin: 12/12 (100%)")
    assert "\r" not in captured.err

    # Standard output is the table of the JSON's reports and nothing else.
    reports = json.loads(out.read_text())
    assert captured.out == (
        "replaying 12 requests, offline, policy round_robin …\n" + format_table(reports) + "\n"
    )
    # The reports are those of a replay that reports no progress.
    replay = OfflineReplay(
        load_trace(small_trace),
        make_policy("round_robin", 0),
        2,
        SimConfig(num_gpu_blocks=2048),
        tiers=TierSettings(),  # the command's defaults
    )
    quiet = tmp_path / "quiet.json"
    write_json(quiet, {"round_robin": replay.run().report})
    expected = json.loads(quiet.read_text())
    for report in (reports, expected):
        report["round_robin"].pop("wall_s")
    assert reports == expected
