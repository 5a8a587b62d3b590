"""An etcd client logs in again when etcd refuses its token: etcd forgets every token when it
restarts (and one unused for ``--auth-token-ttl``), after which aetcd on its own would fail each
call with 'invalid auth token' for good. Against a real etcd with auth on, restarted."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.permissions import Identity
from bus.registry import connect_etcd
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer
from tests.live import admin_etcd

pytestmark = pytest.mark.live

WORKER = Identity("worker", "w1")


@pytest.fixture
def auth(tmp_path: Path) -> ClusterAuth:
    return ClusterAuth(tmp_path / "auth", [WORKER])


@pytest.fixture
def etcd(tmp_path: Path, auth: ClusterAuth) -> Iterator[EmbeddedServer]:
    server = admin_etcd(auth, tmp_path / "etcd")
    yield server
    server.stop()


async def test_calls_go_on_after_etcd_restarts_with_one_new_login(
    etcd: EmbeddedServer, auth: ClusterAuth, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect_etcd(auth.credentials("etcd", WORKER.user).within(etcd.url))
    key = b"/laneway/workers/w1"
    try:
        await client.put(key, b"before")
        etcd.stop()
        etcd.restart()
        reconnect, logins = client.reconnect, []

        async def counted() -> None:
            logins.append(1)
            await reconnect()

        client.reconnect = counted  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="bus.registry"):
            found = await asyncio.gather(*(client.get(key) for _ in range(5)))
        assert [kv.value for kv in found] == [b"before"] * 5
        assert any("logging in again" in r.getMessage() for r in caplog.records)
        assert len(logins) == 1  # five calls refused with the one token: one login
        await client.put(key, b"after")
        assert (await client.get(key)).value == b"after"
        # Still the worker's own rights: a new login is no wider one.
        with pytest.raises(Exception, match="permission denied"):
            await client.put(b"/laneway/workers/w2", b"x")
    finally:
        await client.close()
