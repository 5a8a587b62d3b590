"""/proc's view of a process: CPU seconds, and time ready to run with no CPU free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.proc_stats import COUNTERS, counters, growth, snapshot

# Spinning well past the window: on a loaded machine (make test's other worker) a window of
# 0.5 s once saw the spinners get only 0.2 s of CPU between them.
_SPIN = "import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass"


def test_more_busy_processes_than_cores_wait_for_one() -> None:
    busy = [
        subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range((os.cpu_count() or 1) + 2)
    ]
    try:
        pids = {str(i): p.pid for i, p in enumerate(busy)}
        time.sleep(0.3)
        before = snapshot(pids)
        time.sleep(1.0)
        grown = growth(before, snapshot(pids))
    finally:
        for p in busy:
            p.wait()
    assert set(grown) == set(pids) and all(set(g) == set(COUNTERS) for g in grown.values())
    cpu = sum(g["cpu_s"] for g in grown.values())
    wait = sum(g["wait_s"] for g in grown.values())
    # Two more spinners than cores: the run queue holds about two of them at any time.
    assert cpu > 0.2 and wait > 0.2


def test_a_gone_process_has_no_counters() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert counters(proc.pid) is None
    mine = counters(os.getpid())
    assert mine is not None and mine["cpu_s"] > 0 and mine["wait_s"] >= 0
