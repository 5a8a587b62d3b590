"""Planner replicas take turns out of the requests' intake, on a real etcd: one out at a time,
none while it is the only one registered, the turn free again when its holder is back, and no
turn while etcd does not answer. (A holder that dies loses the turn with its lease.)"""

from __future__ import annotations

import time

from bus.registry import LeasedKey, connect_etcd
from infra.embedded import EmbeddedServer
from services.planner import intake_turn
from services.planner.intake_turn import IntakeTurn


async def test_one_replica_out_at_a_time_and_only_to_others(own_etcd: EmbeddedServer) -> None:
    clients = [connect_etcd(own_etcd.url) for _ in range(3)]
    a, b, c = (IntakeTurn(client, name) for client, name in zip(clients, "abc", strict=True))
    present = [LeasedKey.planner(clients[0], "a", ttl_s=5)]
    try:
        await present[0].start()
        assert not await a.take()  # alone: it keeps taking requests
        present += [LeasedKey.planner(clients[1], "b", ttl_s=5)]
        present += [LeasedKey.planner(clients[2], "c", ttl_s=5)]
        for key in present[1:]:
            await key.start()
        assert await a.take()
        assert not await b.take() and not await c.take()  # a is out
        await a.give_back()
        assert await b.take() and not await a.take()
        await b.give_back()
        assert await c.take()
        await c.give_back()
        own_etcd.kill()
        started = time.monotonic()
        assert not await a.take()  # etcd away: no turn, within the call's bound
        assert time.monotonic() - started < intake_turn.CALL_TIMEOUT_S + 1
    finally:
        for client in clients:
            await client.close()
