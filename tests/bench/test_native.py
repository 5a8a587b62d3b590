"""The mypyc build of the replay's hot path: the sources' figures, and never a stale build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from benchmarks import sim_speed
from infra import native

_COMPILER = shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0])
_HEADERS = Path(sysconfig.get_paths()["include"]) / "Python.h"


def _build(target: Path) -> None:
    command = [sys.executable, "-m", "infra.native", "--target", str(target), "build"]
    subprocess.run(command, check=True, capture_output=True)


def _digest(small_trace: Path, *launch: str) -> tuple[str, str]:
    command = [sys.executable, *launch, "benchmarks.sim_digest", "--trace", str(small_trace)]
    command += ["--workers", "2", "--output-length", "oracle"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)["digest"], done.stderr


# One test for all that needs a build: xdist would give tests sharing a fixture a build each, on
# both workers (40 s of gcc each).
def test_a_build_serves_the_sources_replay_to_the_last_digit(
    tmp_path: Path, small_trace: Path
) -> None:
    if _COMPILER is None or not _HEADERS.exists():
        pytest.skip("no C compiler or no Python headers here to build with")
    _build(tmp_path)
    # The modules come from the build.
    probe = (
        "from pathlib import Path; from infra import native; "
        f"assert native.enable(Path({str(tmp_path)!r})) is None; "
        "import infra.bench.offline as m; print(m.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert Path(done.stdout.strip()).parent == tmp_path / "infra" / "bench"
    # The replay on them is the sources' to the last digit.
    sources, _ = _digest(small_trace, "-m")
    compiled, said = _digest(small_trace, "-m", "infra.native", "--target", str(tmp_path), "run")
    assert "native: compiled" in said
    assert compiled == sources
    # A second build of the same sources is skipped.
    assert native.build(tmp_path) is False


def test_a_build_of_other_sources_is_refused(tmp_path: Path) -> None:
    assert native.enable(tmp_path) == f"no build in {tmp_path} (make native)"
    stale = native.fingerprint()
    # A module the compiled ones import, not one of them: a build depends on it too.
    assert "services.engine.sim.config" not in native.MODULES
    stale["sources"] = {**stale["sources"], "services/engine/sim/config.py": "0" * 64}
    (tmp_path / "sources.json").write_text(json.dumps(stale))
    before = list(sys.meta_path)
    assert "of other sources" in (native.enable(tmp_path) or "")
    assert sys.meta_path == before


def test_a_build_missing_a_module_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sources.json").write_text(json.dumps(native.fingerprint()))
    assert "lacks" in (native.enable(tmp_path) or "")


def test_bench_sim_runs_the_sources_where_the_build_is_not_current(
    small_trace: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(native, "TARGET", tmp_path)  # no build there
    assert sim_speed.main(["--trace", str(small_trace), "--speedup", "1", "--native"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["system"], r["native"]) for r in rows] == [("laneway", False)]
    assert "no current native build" in err
