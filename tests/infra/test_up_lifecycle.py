"""A hard-killed `laneway up` leaves nothing running and the next one on its state dir starts;
a start that cannot happen says why in one line and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bus.runtime import FATAL_PREFIX
from infra.cluster import LocalCluster
from infra.cluster_plan import ClusterConfig
from infra.ports import free_port
from infra.startup import StartupError
from tests.infra.laneway_up import (
    alive,
    api_headers,
    launch,
    processes_naming,
    survivors,
    wait_serving,
)

pytestmark = pytest.mark.live  # starts `laneway up`, its servers and services


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_sigkilled_up_leaves_nothing_and_the_next_up_starts(tmp_path: Path) -> None:
    port = free_port()
    first = launch(port, tmp_path)
    pids = wait_serving(first)
    assert {"nats (embedded)", "etcd (embedded)", "ingress", "planner", "kv-indexer"} <= set(pids)
    recorded = json.loads((tmp_path / "pids.json").read_text())
    assert {name: pid for name, (pid, _) in recorded.items()} == pids

    first.send_signal(signal.SIGKILL)
    first.wait()
    assert survivors(pids, within=5) == {}
    assert processes_naming(tmp_path) == []

    second = launch(port, tmp_path)
    try:
        again = wait_serving(second)
        models = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers=api_headers(tmp_path), timeout=5
        )
        assert models.status_code == 200
    finally:
        second.send_signal(signal.SIGINT)
        assert second.wait(20) == 0
    assert survivors(again, within=5) == {}


def _refusal(port: int, state: Path, *extra: str) -> str:
    """Run a `laneway up` that must refuse to start; its one line of complaint."""
    proc = launch(port, state, *extra)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _nothing_started(state: Path) -> bool:
    return processes_naming(state) == [] and not (state / "pids.json").exists()


def test_up_on_a_taken_http_port_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    line = _refusal(taken_port, tmp_path)
    assert f"127.0.0.1:{taken_port}" in line and "--port" in line and "in use" in line
    assert _nothing_started(tmp_path)


def test_up_on_a_taken_nats_port_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    line = _refusal(free_port(), tmp_path, "--nats-port", str(taken_port))
    assert f"127.0.0.1:{taken_port}" in line and "--nats-port" in line
    assert _nothing_started(tmp_path)


def test_up_with_a_nats_that_does_not_answer_says_so_in_one_line(tmp_path: Path) -> None:
    nowhere = f"nats://127.0.0.1:{free_port()}"
    line = _refusal(free_port(), tmp_path, "--nats-url", nowhere)
    assert nowhere in line and "--nats-url" in line
    assert _nothing_started(tmp_path)


def test_up_on_a_state_dir_in_use_names_its_owner(tmp_path: Path) -> None:
    owner = launch(free_port(), tmp_path)
    try:
        wait_serving(owner)
        line = _refusal(free_port(), tmp_path)
        assert str(tmp_path) in line and f"pid {owner.pid}" in line
    finally:
        owner.send_signal(signal.SIGINT)
        assert owner.wait(20) == 0


def test_a_service_failing_to_start_is_one_line_naming_it(tmp_path: Path) -> None:
    cluster = LocalCluster(
        ClusterConfig(state_dir=tmp_path, http_port=free_port(), env={"LANEWAY_LEASE_TTL_S": "x"})
    )
    with pytest.raises(StartupError) as failure:
        cluster.start(timeout=20)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith("decode-worker-") and "failed to start" in message, message
    assert "lease_ttl_s" in message
    assert not any(alive(pid) for pid in cluster.pids().values())
    assert _nothing_started(tmp_path)


def test_an_ingress_on_a_taken_port_ends_with_one_fatal_line(taken_port: int) -> None:
    # What `laneway up` reports should the port be taken between its check and the ingress.
    env = {**os.environ, "LANEWAY_PORT": str(taken_port)}
    proc = subprocess.run(
        [sys.executable, "-m", "services.ingress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"{FATAL_PREFIX}OSError: cannot listen on 127.0.0.1:{taken_port}: Address already in use"
    ]


EXITING_SERVICE = """
import logging, sys
from bus.runtime import run_service

async def main(stop):
    logging.getLogger("some.library").error("the cause, logged")
    sys.exit(3)  # as uvicorn gives up

run_service(main)
"""


def test_a_service_a_library_exits_ends_with_the_error_it_logged() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EXITING_SERVICE], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == f"{FATAL_PREFIX}the cause, logged (exit code 3)"
    assert "Traceback" not in proc.stderr
