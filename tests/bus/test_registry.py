"""Worker leases and the live worker view against a real etcd."""

from __future__ import annotations

import asyncio

from bus.registry import LeasedKey, connect_etcd, watch_workers
from infra.embedded import EmbeddedServer
from schemas.messages import WorkerRegistration
from tests.helpers import eventually


def registration(worker_id: str) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id,
        role="both",
        engine="sim",
        model="m",
        block_size=16,
        kv_blocks_total=10,
        max_num_seqs=4,
        pid=1,
    )


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
    from bus.registry import SessionStore

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
