"""The capacity loop's etcd side: one leader at a time, and roles that workers watch."""

from __future__ import annotations

import asyncio

from bus.registry import LeasedKey, assign_roles, connect_etcd, watch_role
from infra.embedded import EmbeddedServer
from schemas.events import Role
from tests.helpers import eventually


async def test_one_leader_at_a_time_and_a_successor_when_it_goes(
    etcd_server: EmbeddedServer,
) -> None:
    first, second = connect_etcd(etcd_server.url), connect_etcd(etcd_server.url)
    a, b = LeasedKey.leader(first, "a", ttl_s=2), LeasedKey.leader(second, "b", ttl_s=2)
    try:
        assert await a.start_if_absent()
        assert not await b.start_if_absent()
        assert await a.start_if_absent()  # still leading
        await a.stop()  # resigned (or died: its lease goes the same way)
        assert await b.start_if_absent()
        assert not await a.holds()
    finally:
        await a.stop()
        await b.stop()
        await first.close()
        await second.close()


async def test_a_worker_sees_its_roles_in_order(etcd_server: EmbeddedServer) -> None:
    client = connect_etcd(etcd_server.url)
    seen: list[Role] = []

    async def on_role(role: Role) -> None:
        seen.append(role)

    await assign_roles(client, {"w1": "decode"})
    watcher = asyncio.create_task(watch_role(client, "w1", on_role))

    try:
        await eventually(lambda: seen)
        await assign_roles(client, {"w1": "prefill", "w2": "prefill"})
        await assign_roles(client, {"w2": "decode"})
        await assign_roles(client, {"w1": "decode"})
        await eventually(lambda: len(seen) >= 3)
        assert seen == ["decode", "prefill", "decode"]
    finally:
        watcher.cancel()
        await client.close()
