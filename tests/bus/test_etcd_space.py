"""etcd's space alarm against a real etcd: raised, every write refused; cleared, writes go on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from bus.etcd_space import clear_space_alarm
from bus.permissions import Identity
from bus.registry import connect_etcd
from infra.cluster_auth import ClusterAuth, secure
from infra.embedded import EmbeddedServer, start_etcd


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """An etcd of its own: an alarm on the shared one would refuse other tests' writes."""
    server = start_etcd(tmp_path / "etcd")
    yield server
    server.stop()


async def test_a_raised_space_alarm_is_cleared_and_writes_go_on(own_etcd: EmbeddedServer) -> None:
    client = connect_etcd(own_etcd.url)
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
    own_etcd: EmbeddedServer, tmp_path: Path
) -> None:
    """Its user may compact and disarm but not defragment (etcd's root alone may): the alarm
    still goes, and writes go on."""
    auth = ClusterAuth(tmp_path / "auth", [Identity("planner")])
    secure(auth, "", own_etcd.url, 1, nats=False, etcd=True)
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
