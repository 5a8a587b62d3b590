"""`laneway up --no-bus-auth` on a state dir an authenticated run used: that run turned etcd's
auth on in its data, so every service's first call was refused with "user name is empty". The
cluster turns auth off again as the root whose credentials the state dir kept; where those are
gone it says what to remove instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aetcd
import httpx
import pytest

from bus.permissions import Identity
from infra.cluster import LocalCluster
from infra.cluster_auth import ClusterAuth, open_etcd, secure
from infra.cluster_plan import ClusterConfig
from infra.embedded import EmbeddedServer, start_etcd
from infra.ports import free_port


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = start_etcd(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop()


async def _anonymous_put(url: str) -> None:
    host, port = url.rsplit(":", 1)
    client = aetcd.Client(host=host, port=int(port), timeout=5)
    try:
        await client.put(b"/laneway/probe", b"x")
    finally:
        await client.close()


def _endpoint(server: EmbeddedServer) -> str:
    return server.url.removeprefix("http://")


async def test_auth_left_on_by_an_earlier_run_is_turned_off(
    etcd: EmbeddedServer, tmp_path: Path
) -> None:
    auth = ClusterAuth(tmp_path / "auth", [Identity("planner")])
    secure(auth, "", _endpoint(etcd), 1, nats=False, etcd=True)
    with pytest.raises(aetcd.exceptions.InvalidArgumentError, match="user name is empty"):
        await _anonymous_put(_endpoint(etcd))

    open_etcd(tmp_path / "auth", _endpoint(etcd))
    await _anonymous_put(_endpoint(etcd))
    open_etcd(tmp_path / "auth", _endpoint(etcd))  # off already: nothing to do

    # And on again for the next run with auth, with the same users.
    secure(auth, "", _endpoint(etcd), 1, nats=False, etcd=True)
    with pytest.raises(aetcd.exceptions.InvalidArgumentError, match="user name is empty"):
        await _anonymous_put(_endpoint(etcd))


async def test_without_the_roots_credentials_it_says_so(
    etcd: EmbeddedServer, tmp_path: Path
) -> None:
    auth = ClusterAuth(tmp_path / "auth", [Identity("planner")])
    secure(auth, "", _endpoint(etcd), 1, nats=False, etcd=True)
    (tmp_path / "auth" / "etcd" / "root.json").unlink()
    with pytest.raises(PermissionError, match="auth on"):
        open_etcd(tmp_path / "auth", _endpoint(etcd))
    # A folder that never held credentials (the first run had none) changes nothing either.
    with pytest.raises(PermissionError):
        open_etcd(tmp_path / "elsewhere", _endpoint(etcd))


def test_up_without_bus_auth_on_a_state_dir_a_run_with_it_used(tmp_path: Path) -> None:
    """The whole path: etcd's data as a run with bus auth leaves it (auth on, the root's
    credentials in the state dir), then a cluster without bus auth on that data serves."""
    etcd = start_etcd(tmp_path)  # where the cluster keeps its embedded etcd's data
    try:
        auth = ClusterAuth(tmp_path / "auth", [Identity("planner")])
        secure(auth, "", _endpoint(etcd), 1, nats=False, etcd=True)
    finally:
        etcd.stop()
    cluster = LocalCluster(
        ClusterConfig(state_dir=tmp_path, http_port=free_port(), workers=1, auth=False)
    )
    try:
        cluster.start()
        reply = httpx.post(
            f"{cluster.config.base_url}/completions",
            json={"model": "laneway-sim", "prompt": "hi", "max_tokens": 2},
            headers=cluster.api_headers,
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    finally:
        cluster.stop()
