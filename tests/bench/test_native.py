"""The mypyc build of the replay's hot path: the sources' figures, and never a stale build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from infra import native
from infra.bench import sim_speed

_COMPILER = shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0])
_HEADERS = Path(sysconfig.get_paths()["include"]) / "Python.h"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if _COMPILER is None or not _HEADERS.exists():
        pytest.skip("no C compiler or no Python headers here to build with")
    target = tmp_path_factory.mktemp("native")
    subprocess.run(
        [sys.executable, "-m", "infra.native", "--target", str(target), "build"],
        check=True,
        capture_output=True,
    )
    return target


def _digest(small_trace: Path, *launch: str) -> tuple[str, str]:
    command = [sys.executable, *launch, "infra.bench.sim_digest", "--trace", str(small_trace)]
    command += ["--workers", "2", "--output-length", "oracle"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)["digest"], done.stderr


def test_the_compiled_replay_is_the_sources_to_the_last_digit(
    build: Path, small_trace: Path
) -> None:
    sources, _ = _digest(small_trace, "-m")
    compiled, said = _digest(small_trace, "-m", "infra.native", "--target", str(build), "run")
    assert "native: compiled" in said
    assert compiled == sources


def test_the_modules_come_from_the_build(build: Path) -> None:
    probe = (
        "import sys; from infra import native; "
        f"assert native.enable(native.Path({str(build)!r})) is None; "
        "import infra.bench.offline as m; print(m.__file__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert Path(done.stdout.strip()).parent == build / "infra" / "bench"


def test_a_second_build_of_the_same_sources_is_skipped(build: Path) -> None:
    assert native.build(build) is False


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
