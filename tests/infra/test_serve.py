"""`laneway serve SERVICE`: each service a process of its own, started as a systemd unit or a
container on another host would start it, against the operator's NATS and etcd; with the
provisioned folder, each runs there as its own user (issue 38)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.cli import main
from infra.ports import free_port
from tests.infra.own_servers import OwnServers, include_and_reload, nats_users
from tests.live import FAST_WORKERS

pytestmark = pytest.mark.live  # real nats-server and etcd, and every service a process


class Served:
    """The `laneway serve` processes of a test, stopped at its end."""

    def __init__(self, folder: Path, servers: OwnServers, logs: Path) -> None:
        self.folder, self.servers, self.logs = folder, servers, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.metrics: dict[str, int] = {}
        logs.mkdir(exist_ok=True)

    def start(self, name: str, *args: str) -> None:
        metrics = free_port()
        # A host that runs a service holds no root: only the service's own users.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LANEWAY_ETCD_")}
        env.update(FAST_WORKERS)
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                [
                    *(sys.executable, "-m", "infra.cli", "serve", *args),
                    *("--bus-credentials", str(self.folder)),
                    *("--nats-url", self.servers.nats_plain),
                    *("--etcd-endpoints", self.servers.etcd_plain),
                    *("--metrics-port", str(metrics)),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.metrics[name] = metrics

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for name, port in self.metrics.items():
            while not _ready(port):
                proc = self.procs[name]
                log = (self.logs / f"{name}.log").read_text()[-2000:]
                assert proc.poll() is None, f"{name} exited {proc.returncode}: {log}"
                assert time.monotonic() < deadline, f"{name} not ready: {log}"
                time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def provisioned(own_servers: OwnServers, tmp_path: Path) -> Path:
    folder = tmp_path / "provisioned"
    args = ["bus", "provision", "--out", str(folder), "--etcd-endpoints", own_servers.etcd_plain]
    assert main([*args, "--workers", "4", "--ingresses", "2"]) == 0
    include_and_reload(own_servers, folder)
    return folder


@pytest.fixture
def served(provisioned: Path, own_servers: OwnServers, tmp_path: Path) -> Iterator[Served]:
    served = Served(provisioned, own_servers, tmp_path / "logs")
    try:
        yield served
    finally:
        served.stop()


def test_each_service_in_its_own_process_as_its_own_user(
    served: Served, own_servers: OwnServers, capsys: pytest.CaptureFixture[str]
) -> None:
    ingresses = sorted(p.stem for p in (served.folder / "nats").glob("ingress-*.json"))
    ingress_id = ingresses[1].removeprefix("ingress-")
    http = free_port()
    served.start("kv-indexer", "kv-indexer")
    served.start("planner", "planner")
    served.start("worker-0", "worker")
    served.start("worker-1", "worker")
    served.start("ingress", "ingress", "--id", ingress_id, "--port", str(http))
    served.wait_ready()
    # The API takes keys by default: one made as the operator (root, from the environment).
    assert (
        main(["keys", "create", "--tenant", "t", "--etcd-endpoints", own_servers.etcd_plain]) == 0
    )
    key = capsys.readouterr().out.strip().splitlines()[-1]
    reply = httpx.post(
        f"http://127.0.0.1:{http}/v1/completions",
        json={"model": "laneway-sim", "prompt": "Once upon", "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    anonymous = httpx.post(f"http://127.0.0.1:{http}/v1/completions", json={}, timeout=5)
    assert anonymous.status_code == 401
    users = set(nats_users(own_servers.monitor))
    workers = {u for u in users if u.startswith("worker-")}
    assert len(workers) == 2  # each claimed a user of its own
    assert users == {"kv-indexer-indexer-0", "planner", f"ingress-{ingress_id}", *workers}, users


def test_services_of_a_role_claim_users_no_other_took(
    served: Served, own_servers: OwnServers
) -> None:
    served.start("kv-indexer", "kv-indexer")
    served.start("ingress-0", "ingress", "--port", str(free_port()))
    served.start("ingress-1", "ingress", "--port", str(free_port()))
    served.wait_ready()
    users = nats_users(own_servers.monitor)
    ingresses = [u for u in users if u.startswith("ingress-")]
    assert len(ingresses) == len(set(ingresses)) == 2, users
    # The folder held two ingress users, both claimed: a third has none and says so.
    served.start("ingress-2", "ingress", "--port", str(free_port()))
    assert served.procs["ingress-2"].wait(30) != 0
    assert "laneway bus provision" in (served.logs / "ingress-2.log").read_text()
