"""The offline replay's hot path compiled by mypyc from this checkout's own sources, opt-in.

The pure-Python modules stay what every service, test and tool runs. ``build`` compiles
:data:`MODULES` into a folder beside the checkout (``make native``), with the digest of every
source of the project's packages; ``run`` starts a Python module with those compiled modules in
place of their sources, and only while every source still has the digest it was compiled from:
a stale build would run other code than the checkout holds, so it is refused (and the sources
run).

    .venv/bin/python -m infra.native build [--target DIR]
    .venv/bin/python -m infra.native run MODULE [ARG ...]   # e.g. infra.cli bench --trace ...
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / ".build" / "native"
# The replay's own loop and everything it calls per step or per request, leaves first; not the
# modules of pydantic models (they build their classes at import, uncompilable).
MODULES = (
    "schemas.block_hash",
    "services.common.perf_model",
    "services.common.kv_index.changes",
    "services.common.kv_index.index",
    "services.common.token_times",
    "services.engine.protocol",
    "services.engine.scheduling.text",
    "services.engine.scheduling.request",
    "services.engine.scheduling.block_pool",
    "services.engine.scheduling.kv_manager",
    "services.engine.scheduling.scheduler",
    "services.engine.scheduling.decode_run",
    "services.engine.scheduling.scheduled",
    "services.engine.sim.engine",
    "services.planner.policy",
    "services.planner.routable",
    "services.planner.kv_policy",
    "services.planner.decision",
    "infra.bench.traces",
    "infra.bench.busy",
    "infra.bench.tiers",
    "infra.bench.sim_worker",
    "infra.bench.stepping",
    "infra.bench.offline",
)
_MANIFEST = "sources.json"
# The project's own packages: what the compiled modules can import.
_PACKAGES = ("schemas", "bus", "services", "infra", "observability")
_GROUP = "laneway_native"
# The library of the whole group's code, which each module's own small library loads.
_SHARED = _GROUP + "__mypyc"


def _source(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def fingerprint() -> dict[str, Any]:
    """What a build depends on: the modules compiled, the digest of every source of the project's
    packages, the Python and the compiler. Every source, not only the compiled ones: mypyc
    compiles against what they import (a constant of another module may be written into the
    compiled code), so a change anywhere makes a build stale."""
    import mypy.version  # only a build or a launch needs it

    files = sorted(f for package in _PACKAGES for f in (ROOT / package).rglob("*.py"))
    return {
        "python": sys.version,
        "mypyc": mypy.version.__version__,
        "modules": list(MODULES),
        "sources": {
            f.relative_to(ROOT).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in files
        },
    }


def current(target: Path = TARGET) -> bool:
    """Whether ``target`` holds a build of these very sources, by this Python and compiler."""
    manifest = target / _MANIFEST
    return manifest.exists() and json.loads(manifest.read_text()) == fingerprint()


def build(target: Path = TARGET) -> bool:
    """Compile :data:`MODULES` into ``target`` (C sources and objects in its ``tmp``) unless it
    holds a current build; whether it compiled."""
    target = target.resolve()
    if current(target):
        return False
    from mypyc.build import mypycify  # the compiler only when there is something to compile
    from setuptools import setup

    target.mkdir(parents=True, exist_ok=True)
    (target / _MANIFEST).unlink(missing_ok=True)  # no manifest: no usable build, if this fails
    before = fingerprint()
    with contextlib.chdir(ROOT):  # mypyc names modules by their paths from here
        extensions = mypycify(
            [str(_source(m).relative_to(ROOT)) for m in MODULES],
            opt_level="3",
            group_name=_GROUP,
            target_dir=str(target / "tmp" / "c"),
        )
        setup(
            name="laneway-native",
            ext_modules=extensions,
            script_args=[
                "--quiet",
                "build_ext",
                f"--build-lib={target}",
                f"--build-temp={target / 'tmp'}",
                f"--parallel={os.cpu_count() or 1}",
            ],
        )
    if fingerprint() != before:
        raise RuntimeError("sources changed while they were compiled: build again")
    (target / _MANIFEST).write_text(json.dumps(before, indent=1, sort_keys=True))
    return True


class _Compiled(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and mypyc's shared library) among the build's files."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        file = self._files.get(fullname)
        return None if file is None else importlib.util.spec_from_file_location(fullname, file)


def enable(target: Path = TARGET) -> str | None:
    """Put the build in ``target`` before the sources; why not (None: done). Call it before any
    of :data:`MODULES` is imported: one imported already stays the pure-Python one."""
    if not (target / _MANIFEST).exists():
        return f"no build in {target} (make native)"
    if not current(target):
        return f"the build in {target} is of other sources or another Python (make native)"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    files = {m: target / (m.replace(".", "/") + suffix) for m in MODULES}
    files[_SHARED] = target / (_SHARED + suffix)
    missing = [str(f) for f in files.values() if not f.exists()]
    if missing:
        return f"the build in {target} lacks {', '.join(missing)}"
    loaded = sorted(set(MODULES) & set(sys.modules))
    if loaded:
        return f"imported already, as sources: {', '.join(loaded)}"
    sys.meta_path.insert(0, _Compiled(files))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=TARGET)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="compile the hot path")
    run = commands.add_parser("run", help="run a Python module with the compiled hot path")
    run.add_argument("module")
    run.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "build":
        print("compiled" if build(args.target) else f"{args.target} is up to date")
        return 0
    why = enable(args.target)
    print(f"native: {why or 'compiled'}", file=sys.stderr)
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
