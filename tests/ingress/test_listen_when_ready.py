"""An ingress listens on the API port only once it can answer as its replicas do. Where the port
is shared (SO_REUSEPORT), a listening replica is handed its share of new connections at once, so
one still reading etcd would refuse them (503) while the others serve."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.embedded import EmbeddedServer, start_etcd
from infra.ports import free_ports
from tests.helpers import eventually

pytestmark = pytest.mark.live  # starts an ingress process, a NATS and an etcd


def _readyz(port: int) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0)
    except httpx.HTTPError:
        return None


@pytest.fixture
def ingress(nats_server: EmbeddedServer, tmp_path: Path) -> Iterator[tuple[int, int, int, Path]]:
    """An ingress pointed at an etcd port nothing listens on yet: its API port, metrics port,
    that etcd port and a folder for the etcd."""
    api, metrics, etcd = free_ports(3)
    env = {
        **os.environ,
        "LANEWAY_NATS_URL": nats_server.url,
        "LANEWAY_ETCD_ENDPOINTS": f"127.0.0.1:{etcd}",
        "LANEWAY_PORT": str(api),
        "LANEWAY_REUSE_PORT": "true",
        "LANEWAY_METRICS_PORT": str(metrics),
    }
    log = (tmp_path / "ingress.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.ingress"], env=env, stdout=log, stderr=log
    )
    try:
        yield api, metrics, etcd, tmp_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def test_an_ingress_takes_no_connection_until_it_has_read_etcd(
    ingress: tuple[int, int, int, Path],
) -> None:
    api, metrics, etcd_port, folder = ingress
    await eventually(lambda: _readyz(metrics), timeout=30, message="no /readyz")
    await asyncio.sleep(2)  # well into its etcd retries
    reply = _readyz(metrics)
    assert reply is not None and reply.status_code == 503, reply
    assert b"listening" in reply.content
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{api}/health", timeout=2.0)
    etcd = start_etcd(folder / "etcd", port=etcd_port)
    try:
        await eventually(
            lambda: (reply := _readyz(metrics)) is not None and reply.status_code == 200,
            timeout=30,
            message="not ready once etcd is up",
        )
        # It answers now, with what it read: no worker is registered.
        health = httpx.get(f"http://127.0.0.1:{api}/health", timeout=5.0)
        assert health.status_code == 503 and b"no worker is registered" in health.content
    finally:
        etcd.stop()
