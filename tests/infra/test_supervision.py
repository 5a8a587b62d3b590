"""`laneway up` keeps its children up: a killed service or embedded server is started again on
the same ports, one line each; a child that keeps dying past its budget ends the supervision."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from infra.cluster import LocalCluster
from infra.ports import free_port
from infra.supervisor import GaveUp, RestartPolicy, RestartTracker
from tests.helpers import eventually
from tests.infra.laneway_up import (
    alive,
    api_headers,
    launch,
    processes_naming,
    survivors,
    wait_serving,
)
from tests.live import ClusterFactory


def test_backoff_doubles_to_its_cap_and_the_budget_counts_the_window_only() -> None:
    tracker = RestartTracker(RestartPolicy(1.0, 4.0, budget=4, window_s=60.0))
    assert [tracker.died(t) for t in (0, 1, 2, 3)] == [1.0, 2.0, 4.0, 4.0]
    assert tracker.died(4) is None  # a fifth death within the minute
    calm = RestartTracker(RestartPolicy(1.0, 4.0, budget=1, window_s=60.0))
    assert calm.died(0) == 1.0
    assert calm.died(61) == 1.0  # the first is out of the window: a fresh start


def _recorded(state: Path) -> dict[str, int]:
    known = json.loads((state / "pids.json").read_text())
    return {name: pid for name, (pid, _) in known.items()}


async def _restarted(state: Path, name: str, old: int) -> int:
    """The PID the state dir names for ``name`` once it is a live one other than ``old``."""

    def new_pid() -> int | None:
        pid = _recorded(state).get(name)
        return pid if pid is not None and pid != old and alive(pid) else None

    found: int = await eventually(new_pid, timeout=20, message=f"{name} not restarted")
    return found


async def _completes(http: httpx.AsyncClient) -> bool:
    body = {"model": "laneway-sim", "prompt": "hello", "max_tokens": 4}
    try:
        return (await http.post("/completions", json=body, timeout=5)).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.live
async def test_up_restarts_a_killed_planner_and_nats_and_they_die_with_it(tmp_path: Path) -> None:
    port = free_port()
    up = launch(port, tmp_path)
    try:
        pids = wait_serving(up)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}/v1", headers=api_headers(tmp_path)
        ) as http:
            for name in ("planner", "nats (embedded)"):
                os.kill(pids[name], signal.SIGKILL)
                pids[name] = await _restarted(tmp_path, name, pids[name])
                # Served again: the services found the restarted NATS on the port they know.
                await eventually(lambda: _completes(http), timeout=20)
    finally:
        # Killed outright: what it restarted dies with it as what it started first does.
        up.send_signal(signal.SIGKILL)
        _, err = up.communicate(timeout=30)
    restarts = [line.split()[2] for line in err.splitlines() if "; restart 1 of" in line]
    assert restarts == ["planner", "nats"], err
    assert survivors(pids, within=5) == {}
    assert processes_naming(tmp_path) == []


@pytest.mark.live
def test_a_child_dying_past_its_budget_ends_the_supervision(
    cluster_factory: ClusterFactory,
) -> None:
    cluster: LocalCluster = cluster_factory(
        workers=1, restart=RestartPolicy(first_backoff_s=0.1, budget=1, window_s=60.0)
    )
    stop = threading.Event()
    failure: list[BaseException] = []

    def supervise() -> None:
        try:
            cluster.supervise(stop)
        except GaveUp as exc:
            failure.append(exc)

    # A thread that lives until the supervision ends: what it respawns dies with it.
    thread = threading.Thread(target=supervise)
    thread.start()
    try:
        killed: set[int] = set()
        for _ in range(2):
            # The respawned process, not the one just killed (a loaded machine respawns late).
            deadline = time.monotonic() + 10
            while (proc := cluster.service("kv-indexer").proc) is None or proc.pid in killed:
                assert time.monotonic() < deadline, "the kv-indexer was not respawned"
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            killed.add(proc.pid)
        thread.join(10)
    finally:
        stop.set()
        thread.join(10)
    assert failure, "the supervisor kept restarting past its budget"
    assert "kv-indexer exited 2 times within 60s; giving up" in str(failure[0])
