"""What /proc says of a benchmark's processes: CPU seconds, seconds spent waiting for a CPU, read
and write system calls, memory."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
COUNTERS = ("cpu_s", "wait_s", "syscr", "syscw")


def counters(pid: int) -> dict[str, float] | None:
    """A live process's CPU seconds (user and system, its threads included), the seconds its
    threads were ready to run but waited for a CPU (the scheduler's run queue: on a machine with
    more work than cores, what stretches every hop's latency), and its read(2) and write(2)
    calls (uvloop's and Go's socket I/O; not recv/send), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        wait_ns = _run_queue_ns(Path(f"/proc/{pid}/task"))
    except OSError:
        return None
    # After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
    cpu = (int(fields[11]) + int(fields[12])) / _TICK
    return {
        "cpu_s": cpu,
        "wait_s": wait_ns / 1e9,
        "syscr": float(io["syscr"]),
        "syscw": float(io["syscw"]),
    }


def _run_queue_ns(tasks: Path) -> int:
    """Nanoseconds the threads alive now spent in the run queue (schedstat's second field)."""
    total = 0
    for task in tasks.iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return total


def snapshot(pids: dict[str, int]) -> dict[str, dict[str, float] | None]:
    return {name: counters(pid) for name, pid in pids.items()}


def growth(
    before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]
) -> dict[str, dict[str, float]]:
    """Each process's counters' growth between two snapshots, of those alive at both."""
    return {
        name: {k: a[k] - b[k] for k in COUNTERS}
        for name, a in after.items()
        if a is not None and (b := before.get(name)) is not None
    }


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
