"""A flag value no run could use is one line from argparse and exit 2, before anything starts:
not a traceback, and not a cluster or a replay that goes ahead with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.cli import main


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["up", "--port", "99999"], "argument --port: not a port (1-65535): 99999"),
        (["up", "--nats-port", "0"], "argument --nats-port: must be at least 1, got 0"),
        (["up", "--workers", "-1"], "argument --workers: must be at least 1, got -1"),
        (["up", "--planners", "0"], "argument --planners: must be at least 1, got 0"),
        (["up", "--prefill-workers", "-1"], "argument --prefill-workers: must be at least 0"),
        (["up", "--speedup", "0"], "argument --speedup: must be a positive number, got 0"),
        (["up", "--pool", "alpha"], "argument --pool: not NAME=N: 'alpha'"),
        (["up", "--pool", "alpha=0"], "argument --pool: must be at least 1, got 0"),
        (["up", "--pool", "a b=1"], "argument --pool: not a model name"),
        (["up", "--speedup", "nan"], "argument --speedup: must be a positive number, got nan"),
        (["bench", "--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["bench", "--limit", "0"], "argument --limit: must be at least 1, got 0"),
        (["bench", "--num-gpu-blocks", "0"], "argument --num-gpu-blocks: must be at least 1"),
        (["bench", "--time-scale", "-2"], "argument --time-scale: must be a positive number"),
        (["bench", "--workers", "two"], "argument --workers: not an integer: 'two'"),
        (["bench", "--kv", "moves=1"], "argument --kv: moves is set by --topology"),
        (["bench", "--kv", "weight=1"], "argument --kv: not NAME=VALUE of a kv knob"),
        (["bench", "--kv", "decode_weight=-1"], "argument --kv: must be 0 or more, got -1"),
        (["bench", "--kv", "max_num_batched_tokens=0.5"], "argument --kv: not an integer"),
        (["bench", "--kv", "host_link_gb_s=0"], "argument --kv: host_link_gb_s is set by"),
        (["replay", "x.jsonl", "--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["replay", "x.jsonl", "--num-gpu-blocks", "0"], "argument --num-gpu-blocks: must be"),
        (["bench-engine", "--model", "m", "--concurrency", "0"], "argument --concurrency"),
        (["keys", "create", "--tenant", "t", "--expires-in", "3000000d"], "at most 36500d"),
    ],
)
def test_a_value_no_run_could_use_is_refused_in_one_line(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert complaint in err and "Traceback" not in err, err


def test_a_bench_with_no_decode_worker_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workers", "2", "--prefill-workers", "2", "--limit", "1"]) == 2
    assert "no decode worker: 2 of --workers 2 are prefill workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--pool", "a=1", "--workers", "2"], "--pool NAME=N or --workers N, not both"),
        (["--pool", "a=1", "--prefill-workers", "1"], "--prefill-workers serves one model"),
        (["--pool", "a=1", "--pool", "a=2"], "each --pool NAME once"),
    ],
)
def test_pools_that_cannot_run_together_are_refused_before_anything_starts(
    argv: list[str], complaint: str
) -> None:
    with pytest.raises(SystemExit, match=complaint):
        main(["up", *argv])


def test_a_key_of_unbounded_rate_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--tenant", "t", "--rate", "inf"]) == 2
    assert "--rate must be a positive number" in capsys.readouterr().err


def test_tools_given_a_path_they_cannot_use_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    assert main(["make-tiny-model", str(in_the_way)]) == 2
    assert f"cannot write {in_the_way}" in capsys.readouterr().err
    assert main(["bench-engine", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no model folder at" in capsys.readouterr().err


def _without_the_bench_extra(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``laneway argv`` where numpy and matplotlib are not installed (a product install)."""
    code = (
        "import sys\nsys.modules['numpy'] = sys.modules['matplotlib'] = None\n"
        f"from infra.cli import main\nsys.exit(main({argv!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_without_the_bench_extra_a_benchmark_says_what_to_install(tmp_path: Path) -> None:
    bench = _without_the_bench_extra(["bench", "--limit", "1"])
    assert bench.returncode == 2
    assert "pip install 'laneway[bench]'" in bench.stderr and "Traceback" not in bench.stderr
    # Replaying a recording's decisions is no benchmark: it needs neither.
    replay = _without_the_bench_extra(["replay", str(tmp_path / "none.jsonl")])
    assert "laneway[bench]" not in replay.stderr and "Traceback" not in replay.stderr, replay.stderr
