"""Worker leases and the live worker view against a real etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.registry import (
    WORKERS_PREFIX,
    LeasedKey,
    assign_roles,
    connect_etcd,
    role_key,
    watch_records,
    watch_role,
    watch_workers,
)
from bus.sessions import SessionRefused, SessionStore
from infra.embedded import EmbeddedServer, start_etcd
from infra.ports import free_port
from schemas.events import Role
from schemas.messages import WorkerRegistration
from tests.helpers import eventually, registration


async def test_watch_sees_registration_and_lease_expiry(etcd_server: EmbeddedServer) -> None:
    views: list[set[str]] = []

    async def on_change(workers: dict[str, WorkerRegistration]) -> None:
        views.append(set(workers))

    watcher_client = connect_etcd(etcd_server.url)
    worker_client = connect_etcd(etcd_server.url)
    watcher = asyncio.create_task(watch_workers(watcher_client, on_change))
    lease = LeasedKey.worker(worker_client, registration("leased"), ttl_s=1)
    await lease.start()
    await eventually(lambda: views and "leased" in views[-1])

    # The worker dies: its keep-alive stops, and the key goes with the lease.
    assert lease._task is not None
    lease._task.cancel()
    await eventually(lambda: "leased" not in views[-1])
    watcher.cancel()
    await watcher_client.close()
    await worker_client.close()


async def test_stopping_a_lease_removes_the_worker_at_once(etcd_server: EmbeddedServer) -> None:
    client = connect_etcd(etcd_server.url)
    lease = LeasedKey.worker(client, registration("graceful"), ttl_s=10)
    await lease.start()
    assert (await client.get(lease.key)) is not None
    await lease.stop()
    assert (await client.get(lease.key)) is None
    await client.close()


async def test_two_replicas_claiming_a_session_agree(etcd_server: EmbeddedServer) -> None:
    a = SessionStore(connect_etcd(etcd_server.url), ttl_s=30)
    b = SessionStore(connect_etcd(etcd_server.url), ttl_s=30)
    owners = await asyncio.gather(a.claim("conv-1", "worker-a"), b.claim("conv-1", "worker-b"))
    assert owners[0] == owners[1]
    assert await a.owner("conv-1") == await b.owner("conv-1") == owners[0]
    await b.move("conv-1", "worker-c")
    assert await a.owner("conv-1") == "worker-c"
    assert await a.owner("conv-unknown") is None


async def test_an_expired_lease_is_taken_out_again(etcd_server: EmbeddedServer) -> None:
    """A process that was paused past its TTL registers again once it runs."""
    client = connect_etcd(etcd_server.url)
    lease = LeasedKey.worker(client, registration("paused"), ttl_s=1)
    await lease.start()
    try:
        assert lease._lease is not None
        await lease._lease.revoke()  # what expiry does while the process cannot refresh
        assert await client.get(lease.key) is None
        await eventually(lambda: client.get(lease.key), interval=0.1)
    finally:
        await lease.stop()
        await client.close()


async def test_malformed_and_foreign_values_are_skipped_once_and_the_watch_goes_on(
    etcd_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """One bad value under the workers prefix used to fail the watch every second, so that a
    worker lost afterwards was never noticed."""
    client = connect_etcd(etcd_server.url)
    garbage = WORKERS_PREFIX + b"garbage"
    foreign = WORKERS_PREFIX + b"not-its-key"
    views: list[set[str]] = []

    async def on_change(workers: dict[str, WorkerRegistration]) -> None:
        views.append(set(workers))

    await client.put(garbage, b"\xff not a registration")
    await client.put(foreign, registration("someone-else").model_dump_json().encode())
    watcher = asyncio.create_task(watch_workers(client, on_change))
    lease = LeasedKey.worker(client, registration("late"), ttl_s=1)
    try:
        await eventually(lambda: views)
        assert "someone-else" not in views[-1]
        await client.put(garbage, b"{}")  # a second bad value at the same key: no new warning
        await lease.start()
        await eventually(lambda: "late" in views[-1])
        assert lease._task is not None
        lease._task.cancel()  # the worker dies
        await eventually(lambda: "late" not in views[-1])
    finally:
        watcher.cancel()
        await lease.stop()
        await client.delete(garbage)
        await client.delete(foreign)
        await client.close()
    skips = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert len(skips) == 2, skips
    assert not [r for r in caplog.records if "watch broke" in r.getMessage()]


async def test_an_unknown_role_is_skipped_and_the_next_one_is_heard(
    etcd_server: EmbeddedServer,
) -> None:
    client = connect_etcd(etcd_server.url)
    roles: list[Role] = []

    async def on_role(role: Role) -> None:
        roles.append(role)

    await client.put(role_key("role-skip"), b"teapot")
    watcher = asyncio.create_task(watch_role(client, "role-skip", on_role))
    try:
        await client.put(role_key("role-skip"), b"\xfe")
        await assign_roles(client, {"role-skip": "decode"})
        await eventually(lambda: roles == ["decode"])
    finally:
        watcher.cancel()
        await client.delete(role_key("role-skip"))
        await client.close()


async def test_a_session_key_etcd_refuses_is_refused_not_retried(
    etcd_server: EmbeddedServer,
) -> None:
    client = connect_etcd(etcd_server.url)
    sessions = SessionStore(client, ttl_s=30)
    huge = "s" * 2_000_000  # past etcd's request limit, the size a 900 KB id took in a claim
    try:
        async with asyncio.timeout(10):
            with pytest.raises(SessionRefused):
                await sessions.claim(huge, "worker-a")
            with pytest.raises(SessionRefused):
                await sessions.move(huge, "worker-a")
        # A binding that is no worker id is no binding.
        await client.put(SessionStore.key("mangled"), b"\xff\xfe")
        assert await sessions.owner("mangled") is None
        assert await sessions.claim("mangled", "worker-a") == "worker-a"
    finally:
        await client.delete(SessionStore.key("mangled"))
        await client.close()


@pytest.mark.live  # starts an etcd of its own
async def test_watches_waiting_for_an_etcd_that_comes_up_all_begin(tmp_path: Path) -> None:
    # Each watcher's failed call reconnects the one client, and a reconnect cancels the calls
    # in flight on the channel it closes: those must be retried, not end their watcher.
    port = free_port()
    client = connect_etcd(f"127.0.0.1:{port}")
    seen: set[bytes] = set()

    def watching(prefix: bytes) -> asyncio.Task[None]:
        async def on_change(records: dict[bytes, bytes]) -> None:
            seen.add(prefix)

        return asyncio.create_task(watch_records(client, prefix, "test", _raw, on_change))

    prefixes = [b"/laneway/test/a/", b"/laneway/test/b/", b"/laneway/test/c/", b"/laneway/test/d/"]
    watchers = [watching(prefix) for prefix in prefixes]
    await asyncio.sleep(2)  # every one of them failing and reconnecting
    etcd = await asyncio.to_thread(start_etcd, tmp_path / "etcd", port)
    try:
        await eventually(lambda: seen == set(prefixes), timeout=20, message="a watch never began")
        assert not any(w.done() for w in watchers)
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await client.close()
        etcd.stop()


def _raw(key: bytes, value: bytes) -> bytes:
    return value
