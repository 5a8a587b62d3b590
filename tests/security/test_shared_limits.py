"""Tenant limits across ingress replicas (services.ingress.shared_limits) on a real etcd: two
replicas together admit no more than the tenant's limit, see each other's token charges, give a
dead replica's requests back with its lease, and hold each its share, never unlimited, while
etcd is away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from bus.registry import connect_etcd
from bus.tenancy import REPLICAS_PREFIX, TENANCY_PREFIX, tenant_prefix
from infra.embedded import EmbeddedServer
from services.ingress.limits import TenantLimits
from services.ingress.shared_limits import TenantGate
from tests.helpers import eventually

pytestmark = pytest.mark.live  # an etcd of its own, killed


@pytest.fixture
async def replicas(own_etcd: EmbeddedServer) -> AsyncIterator[list[TenantGate]]:
    clients = [connect_etcd(own_etcd.url) for _ in range(2)]
    gates = [TenantGate(f"r{i}", c, ttl_s=2) for i, c in enumerate(clients)]
    running = [asyncio.create_task(g.run()) for g in gates]
    yield gates
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    for client in clients:
        await client.close()


def limit(gates: list[TenantGate], **limits: float) -> None:
    for gate in gates:
        gate.set_limits({"acme": TenantLimits(**limits)})  # type: ignore[arg-type]


async def test_a_burst_on_two_replicas_admits_the_limit_and_no_more(
    replicas: list[TenantGate],
) -> None:
    limit(replicas, max_concurrency=4)
    answers = await asyncio.gather(*(replicas[i % 2].enter("acme") for i in range(24)))
    assert answers.count(None) == 4
    # Twelve claims queued on each replica's lock are a busy replica, not etcd away.
    assert all(gate.shared for gate in replicas)
    assert sum(g.in_flight("acme") for g in replicas) == 4
    # One ends on one replica: the other may take its slot, once it is written.
    holder = next(g for g in replicas if g.in_flight("acme"))
    other = next(g for g in replicas if g is not holder)
    assert await other.enter("acme") == 1
    holder.leave("acme")

    async def admitted() -> bool:
        return await other.enter("acme") is None

    await eventually(admitted, timeout=5)
    assert sum(g.in_flight("acme") for g in replicas) == 4


async def test_far_below_its_limit_a_tenant_is_admitted_from_a_reserve_the_others_count(
    replicas: list[TenantGate], own_etcd: EmbeddedServer
) -> None:
    one, two = replicas
    limit(replicas, max_concurrency=40)
    assert await one.enter("acme") is None  # claimed, with slots in reserve
    own_etcd.kill()
    try:
        # No round trip: etcd gone is not even noticed.
        for _ in range(3):
            assert await one.enter("acme") is None
        assert one.shared
    finally:
        own_etcd.restart()
    # The other replica counts the reserve as held, and it goes back once unused.
    for _ in range(4):
        one.leave("acme")
    await eventually(lambda: one.shared, timeout=15)

    async def reserve_back() -> bool:
        two.set_limits({"acme": TenantLimits(max_concurrency=1)})
        wait = await two.enter("acme")
        if wait is None:
            two.leave("acme")
        return wait is None

    await eventually(reserve_back, timeout=10)


async def test_many_tenants_first_claims_share_one_lease_and_unlimited_ones_keep_nothing(
    replicas: list[TenantGate], own_etcd: EmbeddedServer
) -> None:
    gate = replicas[0]
    tenants = [f"t{i}" for i in range(6)]
    gate.set_limits({t: TenantLimits(max_concurrency=2) for t in tenants})
    assert await asyncio.gather(*(gate.enter(t) for t in tenants)) == [None] * 6
    client = connect_etcd(own_etcd.url)
    try:
        records = await client.get_prefix(TENANCY_PREFIX)
        leases = {kv.lease for kv in records if not kv.key.startswith(REPLICAS_PREFIX)}
        assert len(leases) == 1 and 0 not in leases
        # A tenant's limits gone (its key revoked): its record goes, its count stays.
        gate.set_limits({})

        async def gone() -> bool:
            left = await client.get_prefix(tenant_prefix("t0"))
            return len(list(left)) == 0

        await eventually(gone, timeout=5)
        assert gate.in_flight("t0") == 1
    finally:
        await client.close()
    for tenant in tenants:
        gate.leave(tenant, tokens=10)
        for _ in range(3):
            assert await gate.enter(tenant) is None
            gate.leave(tenant, tokens=10)
    # Nothing is kept for tenants without limits (their records' deletion written first).
    await eventually(lambda: not gate._own, timeout=5)


async def test_rate_holds_across_replicas(replicas: list[TenantGate]) -> None:
    limit(replicas, rate_per_s=3.0)
    answers = [await replicas[i % 2].enter("acme") for i in range(6)]
    assert answers[:3] == [None] * 3
    assert all(a is not None and a <= 2 for a in answers[3:])  # a second, and a tenth


async def test_token_charges_on_one_replica_hold_the_quota_on_the_other(
    replicas: list[TenantGate],
) -> None:
    one, two = replicas
    limit(replicas, tokens_per_minute=1000)
    assert await one.enter("acme") is None
    one.leave("acme", tokens=1000)

    async def refused() -> bool:
        wait = await two.enter("acme")
        if wait is None:
            two.leave("acme")
        return wait is not None and 55 <= wait <= 61

    await eventually(refused, timeout=5)


async def test_a_dead_replicas_requests_come_back_with_its_lease(
    replicas: list[TenantGate], own_etcd: EmbeddedServer
) -> None:
    limit(replicas, max_concurrency=2)
    doomed_client = connect_etcd(own_etcd.url)
    doomed = TenantGate("doomed", doomed_client, ttl_s=2)
    doomed.set_limits({"acme": TenantLimits(max_concurrency=2)})
    assert await doomed.enter("acme") is None
    assert await doomed.enter("acme") is None
    assert await replicas[0].enter("acme") == 1
    await doomed_client.close()  # dies: no leave, no keep-alive; its lease lapses in 2 s

    async def admitted() -> bool:
        return await replicas[0].enter("acme") is None

    await eventually(admitted, timeout=8)


async def test_etcd_away_each_replica_holds_its_share_and_logs_once(
    replicas: list[TenantGate], own_etcd: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    one, two = replicas
    limit(replicas, max_concurrency=4)
    # Both replicas have marked themselves live: each knows the other's there.
    await eventually(lambda: one._replicas == two._replicas == 2, timeout=5)
    own_etcd.kill()
    with caplog.at_level(logging.WARNING, logger="services.ingress.shared_limits"):
        answers = [await one.enter("acme") for _ in range(5)]
        # Half of 4 on this replica, refused past it: degraded, never unlimited.
        assert answers == [None, None, 1, 1, 1]
        assert not one.shared
        away = [r for r in caplog.records if "etcd unreachable" in r.getMessage()]
        assert len(away) == 1
        own_etcd.restart()
        await eventually(lambda: one.shared, timeout=15)
    # Back: the replica's two requests were written again and count against the other's.
    assert await two.enter("acme") is None
    assert await two.enter("acme") is None
    assert await two.enter("acme") == 1
