"""etcd away: session ownership answers from cached owners at once, never hangs, logs once, and
comes back to etcd when it answers again."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from bus.registry import connect_etcd
from bus.sessions import SessionStore
from infra.embedded import EmbeddedServer
from tests.helpers import eventually

pytestmark = pytest.mark.live  # an etcd of its own, killed


def _metric(store: SessionStore, name: str) -> float:
    return next(
        sample.value
        for family in store.metrics.collect()
        for sample in family.samples
        if sample.name == name
    )


async def test_owners_come_from_the_watch_while_etcd_is_away(
    own_etcd: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    mine, other = connect_etcd(own_etcd.url), connect_etcd(own_etcd.url)
    store = SessionStore(mine, ttl_s=60, call_timeout_s=0.5, probe_after_s=0.5)
    watching = asyncio.create_task(store.watch())
    try:
        assert await store.claim("alice", "w1") == "w1"
        # Another replica's claim reaches this one's cache through the watch only.
        await SessionStore(other, ttl_s=60).claim("bob", "w2")
        await eventually(lambda: store._cached.get("bob") == "w2")

        own_etcd.kill()
        with caplog.at_level(logging.WARNING, logger="bus.sessions"):
            started = time.monotonic()
            assert await store.owner("bob") == "w2"
            assert await store.owner("alice") == "w1"
            assert await store.owner("carol") is None
            assert await store.claim("carol", "w3") == "w3"
            await store.move("alice", "w2")
            assert await store.owner("alice") == "w2"
            # One bounded wait to find etcd gone, the rest skip it.
            assert time.monotonic() - started < 1.5
            assert store.degraded
            assert _metric(store, "laneway_planner_sessions_degraded") == 1
            # The claim that found etcd gone, the move, the owner after them (the owners before
            # came from the watch's cache, or from degraded mode had the watch seen etcd go).
            assert _metric(store, "laneway_planner_sessions_degraded_calls_total") >= 3
            await asyncio.sleep(0.6)  # past the probe interval: one more bounded try
            assert await store.owner("bob") == "w2"
        away = [r for r in caplog.records if "etcd unreachable" in r.getMessage()]
        assert len(away) == 1

        own_etcd.restart()
        await asyncio.sleep(0.6)
        # Back to etcd: a binding only etcd knows is read from it.
        await SessionStore(other, ttl_s=60).move("dave", "w4")

        async def dave() -> str | None:
            return await store.owner("dave")

        assert await eventually(dave, timeout=15) == "w4"
        assert not store.degraded
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await mine.close()
        await other.close()


async def test_owners_take_no_round_trip_to_etcd_while_the_watch_follows_it(
    own_etcd: EmbeddedServer,
) -> None:
    mine, other = connect_etcd(own_etcd.url), connect_etcd(own_etcd.url)
    store = SessionStore(mine, ttl_s=60)
    watching = asyncio.create_task(store.watch())
    try:
        assert await store.claim("alice", "w1") == "w1"
        await eventually(lambda: store._synced)

        async def no_get(key: bytes) -> None:
            raise AssertionError("an owner was read from etcd")

        mine.get = no_get
        assert await store.owner("alice") == "w1"
        assert await store.owner("carol") is None
        await SessionStore(other, ttl_s=60).claim("bob", "w2")

        async def bob() -> str | None:
            return await store.owner("bob")

        assert await eventually(bob) == "w2"
        # A binding the watch has not shown yet is still found by the claim, which etcd decides.
        await SessionStore(other, ttl_s=60).claim("dave", "w4")
        assert await store.claim("dave", "w3") == "w4"
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await mine.close()
        await other.close()
