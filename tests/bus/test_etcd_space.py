"""etcd's space alarm against a real etcd: raised, every write refused; cleared, writes go on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from bus.etcd_space import clear_space_alarm
from bus.permissions import Identity
from bus.registry import connect_etcd
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer
from tests.live import admin_etcd


@pytest.fixture
def auth(tmp_path: Path) -> ClusterAuth:
    return ClusterAuth(tmp_path / "auth", [Identity("planner")])


@pytest.fixture
def own_etcd(tmp_path: Path, auth: ClusterAuth) -> Iterator[EmbeddedServer]:
    """An etcd of its own, auth on: an alarm on the shared one would refuse other tests'
    writes."""
    server = admin_etcd(auth, tmp_path / "etcd")
    yield server
    server.stop()


async def test_a_raised_space_alarm_is_cleared_and_writes_go_on(
    own_etcd: EmbeddedServer, auth: ClusterAuth
) -> None:
    """As etcd's root, the one user that may also defragment (an operator's tool)."""
    client = connect_etcd(auth.etcd_root.within(own_etcd.url))
    try:
        assert not await clear_space_alarm(client)
        for i in range(50):  # history for the compaction to drop
            await client.put(b"/laneway/sessions/churn", str(i).encode())
        await client.create_alarm()
        with pytest.raises(aetcd.exceptions.ClientError, match="space"):
            await client.put(b"/laneway/sessions/blocked", b"w")
        assert await clear_space_alarm(client)
        await client.put(b"/laneway/sessions/after", b"w")
        assert [a async for a in client.list_alarms()] == []
        assert not await clear_space_alarm(client)
    finally:
        await client.close()


async def test_the_planner_clears_the_alarm_with_etcd_auth_on(
    own_etcd: EmbeddedServer, auth: ClusterAuth
) -> None:
    """Its user may compact and disarm but not defragment (etcd's root alone may): the alarm
    still goes, and writes go on."""
    root = connect_etcd(auth.etcd_root.within(own_etcd.url))
    planner = connect_etcd(auth.credentials("etcd", "planner").within(own_etcd.url))
    try:
        await root.create_alarm()
        with pytest.raises(aetcd.exceptions.ClientError, match="space"):
            await planner.put(b"/laneway/sessions/blocked", b"w")
        assert await clear_space_alarm(planner)
        await planner.put(b"/laneway/sessions/after", b"w")
        assert [a async for a in planner.list_alarms()] == []
    finally:
        await planner.close()
        await root.close()
