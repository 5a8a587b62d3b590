"""A CPU quota on a group of processes (a cgroup's CFS bandwidth), so that a benchmark can make
one service the cluster's bottleneck on a machine with few cores: cgroup v2 where its root
delegates the cpu controller, else v1's cpu hierarchy. Needs root; says so when it cannot."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

_PERIOD_US = 100_000
_V2 = Path("/sys/fs/cgroup")
_V1 = Path("/sys/fs/cgroup/cpu")


class NoCpuCap(RuntimeError):
    """This machine (or this user) cannot cap a process's CPU."""


def _root() -> tuple[Path, bool]:
    """The hierarchy to make groups in, and whether it is v2."""
    # Children get cpu.max only where the root hands the controller down.
    controllers = _V2 / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return _V2, True
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, False
    raise NoCpuCap("no cgroup cpu controller (v2's, or v1's at /sys/fs/cgroup/cpu)")


@contextlib.contextmanager
def cpu_cap(name: str, cores: float, pids: list[int]) -> Iterator[Path]:
    """Hold ``pids`` (every thread of each) to ``cores`` of CPU time together, in a group made
    for the block and removed after it (its processes back in the root group)."""
    root, v2 = _root()
    group = root / f"{name}-{os.getpid()}"
    try:
        group.mkdir()
        quota = str(max(1_000, int(cores * _PERIOD_US)))
        if v2:
            (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(quota)
        for member in pids:
            (group / "cgroup.procs").write_text(str(member))
    except OSError as err:  # not root, a read-only cgroup fs, a controller not delegated
        with contextlib.suppress(OSError):  # the group may never have been made
            _release(root, group)
        raise NoCpuCap(f"cannot make a cpu cgroup under {root}: {err}") from None
    try:
        yield group
    finally:
        _release(root, group)


def _release(root: Path, group: Path) -> None:
    """Its processes back in the root group, uncapped, and the group removed."""
    for held in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):  # gone meanwhile
            (root / "cgroup.procs").write_text(held)
    group.rmdir()
