"""`make bench-scale`'s parts: a real CPU quota holds a busy process to its share, and the
sizing table reads processes as their services."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.cpu_cap import NoCpuCap, cpu_cap
from benchmarks.proc_stats import counters
from benchmarks.scale_out import service_of, sizing


@pytest.mark.parametrize(
    ("process", "service"),
    [
        ("ingress", "ingress"),
        ("ingress-1", "ingress"),
        ("planner-0", "planner"),
        ("decode-worker-3", "worker"),
        ("prefill-worker-0", "worker"),
        ("kv-indexer", "kv-indexer"),
        ("nats", "nats"),
    ],
)
def test_processes_are_read_as_their_services(process: str, service: str) -> None:
    assert service_of(process) == service


def test_sizing_is_requests_a_second_per_core_busiest_first() -> None:
    run = {"rps": 400.0, "cores": {"planner": 0.4, "ingress": 0.5, "load-client": 0.3}}
    assert sizing(run) == [
        {"service": "ingress", "cores": 0.5, "ms_per_request": 1.25, "rps_per_core": 800},
        {"service": "planner", "cores": 0.4, "ms_per_request": 1.0, "rps_per_core": 1000},
    ]


def test_a_capped_busy_process_gets_its_quota_and_is_let_go_after() -> None:
    spin = "import time\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        try:
            with cpu_cap("lw-test-cap", 0.2, [proc.pid]) as group:
                assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
                share = _share(proc.pid, 2.0)
        except NoCpuCap as err:
            pytest.skip(str(err))
        assert 0.08 < share < 0.3, share  # a core's fifth (less on a machine busy elsewhere)
        assert not group.exists()
        root = group.parent / "cgroup.procs"
        assert str(proc.pid) in root.read_text().split()  # back in the root group, uncapped
    finally:
        proc.kill()
        proc.wait()


def _share(pid: int, seconds: float) -> float:
    before = counters(pid)
    time.sleep(seconds)
    after = counters(pid)
    assert before is not None and after is not None
    return (after["cpu_s"] - before["cpu_s"]) / seconds
