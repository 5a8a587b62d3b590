"""What one worker's own credentials could still do to a running cluster (issue 36, finding 7),
each against a real cluster with Laneway's auth on, as `laneway up` starts it:

- flood the services' logs with forged and undecodable events: each is counted in
  ``laneway_bus_dropped_events_total``, and the log says so about once per reason per 10 s;
- register without a lease, so that its record never expires: not counted as a worker;
- keep a frozen worker's lease alive (any etcd user may refresh any lease): the worker is not
  counted live once its load reports stop, and is again when they resume;
- compact etcd (its RBAC cannot forbid it): the services' watches go on."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NatsClient

from bus.credentials import Credentials, split_credentials
from bus.permissions import Identity
from bus.registry import WORKERS_PREFIX, EtcdCluster, etcd_endpoints, watch_records
from bus.topology import Subjects
from infra.cluster import LocalCluster
from infra.cluster_auth import ClusterAuth, identity_of
from infra.cluster_plan import Service
from infra.embedded import is_nats
from schemas.codec import encode
from schemas.events import KvBlocksStored, TokensGenerated, WorkerLoadReported, new_id
from services.common.liveness import QUIET_S
from tests.helpers import eventually, registration
from tests.live import ClusterFactory, metric

FLOOD = 3000  # forged messages of each kind
# A key only the admin writes, for the compaction race.
SCRATCH = b"/laneway/test/compaction"


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=2)


def _auth(cluster: LocalCluster) -> ClusterAuth:
    """The cluster's credentials, as its state dir keeps them (every identity it runs)."""
    return ClusterAuth(
        cluster.config.state_dir / "auth", [identity_of(s) for s in cluster.services]
    )


def _workers(cluster: LocalCluster) -> list[Service]:
    return [s for s in cluster.services if s.module.startswith("services.worker.")]


def _worker_id(service: Service) -> str:
    return service.env["LANEWAY_WORKER_ID"]


async def _nats_as(cluster: LocalCluster, identity: Identity) -> NatsClient:
    creds = _auth(cluster).credentials("nats", identity.user)
    return await nats.connect(
        creds.within(split_credentials(cluster.nats_url)[1]), allow_reconnect=False
    )


def _etcd_as(cluster: LocalCluster, creds: Credentials | None = None) -> EtcdCluster:
    """None: the admin (the cluster's own endpoints carry its credentials)."""
    endpoints = cluster.etcd_endpoints
    creds = creds or split_credentials(endpoints)[0]
    return EtcdCluster(etcd_endpoints(endpoints), failover_s=0.0, credentials=creds)


def _dropped(service: Service, reason: str) -> Awaitable[float]:
    return metric(service, "laneway_bus_dropped_events_total", {"reason": reason})


async def _health_workers(cluster: LocalCluster) -> int | None:
    """The live workers ``/health`` counts (None while it says the cluster is not ready)."""
    root = cluster.config.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=5) as http:
        reply = await http.get("/health")
    workers: int | None = reply.json().get("workers") if reply.status_code == 200 else None
    return workers


async def _health_counts(cluster: LocalCluster, workers: int, timeout: float) -> None:
    async def counted() -> bool:
        return await _health_workers(cluster) == workers

    await eventually(counted, timeout=timeout, message=f"/health never counted {workers}")


def _log(cluster: LocalCluster, service: Service) -> Path:
    return cluster.logs / f"{service.name}.log"


async def test_forged_events_are_all_counted_and_logged_once_per_reason(
    cluster: LocalCluster,
) -> None:
    """The issue's flood: a worker's credentials send undecodable messages and events naming
    another worker to an ingress's token subject, and KV events naming another worker to its
    own KV subject, which the kv-indexer folds. Every one is dropped and counted; the logs grow
    by a line or two per reason, not one (or a traceback) per message."""
    w1, w2 = _workers(cluster)
    (ingress,) = cluster.ingresses()
    indexer = cluster.service("kv-indexer")
    sizes = {s.name: _log(cluster, s).stat().st_size for s in (ingress, indexer)}
    before = {
        "undecodable": await _dropped(ingress, "undecodable"),
        "impostor": await _dropped(ingress, "impostor"),
        "kv": await _dropped(indexer, "impostor"),
    }
    attacker = await _nats_as(cluster, identity_of(w1))
    try:
        tokens = Subjects.tokens(ingress.env["LANEWAY_INSTANCE_ID"], _worker_id(w1)).subject
        forged = encode(
            TokensGenerated(
                source="worker/x",
                request_id="victim",
                worker_id=_worker_id(w2),
                index=0,
                token_ids=(1,),
                text="x",
            )
        )
        kv = encode(KvBlocksStored(source="x", worker_id=_worker_id(w2), seq=1, block_hashes=(1,)))
        started = time.monotonic()
        for i in range(FLOOD):
            await attacker.publish(tokens, b"\x00 not an event %d" % i)
            await attacker.publish(tokens, forged)
            await attacker.publish(Subjects.kv(_worker_id(w1)).subject, kv)
        await attacker.flush()
    finally:
        await attacker.close()

    async def counted() -> bool:
        return (
            await _dropped(ingress, "undecodable") - before["undecodable"] == FLOOD
            and await _dropped(ingress, "impostor") - before["impostor"] == FLOOD
            and await _dropped(indexer, "impostor") - before["kv"] == FLOOD
        )

    await eventually(counted, timeout=30, interval=0.2, message="not every drop was counted")
    # One line per reason per 10 s, and one more where the flood crossed an interval's end.
    per_reason = 2 + int((time.monotonic() - started) // 10)
    for service, reasons in ((ingress, 2), (indexer, 1)):
        grown = _log(cluster, service).read_bytes()[sizes[service.name] :].decode()
        assert len(grown.splitlines()) <= reasons * per_reason, grown
        assert "Traceback" not in grown


async def test_a_leaseless_registration_is_not_counted(cluster: LocalCluster) -> None:
    """A worker's credentials write its registration without a lease (so it would never expire)
    and send its load reports: neither the ingress's /health nor the planner counts it, and
    each says in its log why."""
    ghost = await _ghost(cluster)
    key = WORKERS_PREFIX + ghost.instance.encode()
    etcd = _etcd_as(cluster, _auth(cluster).credentials("etcd", ghost.user))
    planner = cluster.service("planner")
    (ingress,) = cluster.ingresses()
    sizes = {s.name: _log(cluster, s).stat().st_size for s in (planner, ingress)}
    await _health_counts(cluster, 2, timeout=5)
    async with _reporting(cluster, ghost):
        try:
            await etcd.put(key, registration(ghost.instance).model_dump_json().encode())
            # A watch brings a change within milliseconds, and the ghost reports every 0.2 s.
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                assert await _health_workers(cluster) == 2
                assert await metric(planner, "laneway_planner_workers") == 2
                await asyncio.sleep(0.1)

            def said_why() -> bool:
                return all(
                    b"has no lease" in _log(cluster, s).read_bytes()[sizes[s.name] :]
                    for s in (planner, ingress)
                )

            await eventually(said_why, timeout=5, message="the leaseless key went unnoticed")
        finally:
            await etcd.delete(key)
            await etcd.close()


async def test_a_frozen_worker_is_not_counted_though_another_user_keeps_its_lease(
    cluster: LocalCluster,
) -> None:
    """The issue's frozen worker: stopped (SIGSTOP) while another worker's credentials keep its
    lease alive, it stays registered in etcd, but its load reports stop: /health stops counting
    it within QUIET_S (and the planner routes around it), until it runs again."""
    keeper, victim = _workers(cluster)
    assert victim.proc is not None
    key = WORKERS_PREFIX + _worker_id(victim).encode()
    admin = _etcd_as(cluster)
    lease = (await admin.get(key)).lease
    other = _etcd_as(cluster, _auth(cluster).credentials("etcd", identity_of(keeper).user))

    async def keep_alive() -> None:
        while True:
            await other.refresh_lease(lease)
            await asyncio.sleep(0.3)

    await _health_counts(cluster, 2, timeout=5)
    victim.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    keeping = asyncio.create_task(keep_alive())
    try:
        await _health_counts(cluster, 1, timeout=QUIET_S + 3)
        took = time.monotonic() - stopped
        await asyncio.sleep(max(0.0, 2 * 2 + 0.5 - took))  # past twice its lease's TTL (2 s)
        assert await admin.get(key) is not None  # the lease was kept: only the reports tell
        assert await _health_workers(cluster) == 1
        await _complete(cluster)  # routed to the worker that runs
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        await other.close()
        await admin.close()
    await _health_counts(cluster, 2, timeout=QUIET_S + 3)  # it runs again: reports, counted
    assert took <= QUIET_S + 1.5, took


async def test_a_compaction_by_a_worker_leaves_the_watches_working(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's credentials compact etcd to its latest revision: a watch whose start was read
    just before (the one place a compaction can reach it) reads again at once, and the
    services' own watches still see the next change: a leased registration, which the ingress
    and the planner count (and the leaseless one above they did not)."""
    w1 = _workers(cluster)[0]
    attacker = _etcd_as(cluster, _auth(cluster).credentials("etcd", identity_of(w1).user))
    ghost = await _ghost(cluster)
    ghost_etcd = _etcd_as(cluster, _auth(cluster).credentials("etcd", ghost.user))
    admin = _etcd_as(cluster)
    seen: list[set[bytes]] = []

    async def on_change(records: dict[bytes, bytes]) -> None:
        seen.append(set(records))

    async def compact() -> None:
        # Two writes after the read, then compacted up to the second: the watch would start at
        # the first, which is gone.
        for _ in range(2):
            await admin.put(SCRATCH, b"x")
        await attacker.compact((await admin.get(SCRATCH)).mod_revision)

    watcher = asyncio.create_task(
        # A name of its own: the warning is logged once per name every 10 s in this process,
        # and tests/bus/test_registry.py's watches compact too.
        watch_records(_Raced(admin, compact), WORKERS_PREFIX, "raced", _raw, on_change)
    )
    try:
        async with _reporting(cluster, ghost):
            lease = await ghost_etcd.lease(2)
            key = WORKERS_PREFIX + ghost.instance.encode()
            await ghost_etcd.put(
                key, registration(ghost.instance).model_dump_json().encode(), lease=lease
            )
            await eventually(lambda: seen and key in seen[-1], timeout=5)
            # The race was run: the watch started behind the compaction, and read again.
            assert any("compact" in f"{r.getMessage()} {r.exc_info}" for r in caplog.records), (
                caplog.text
            )
            await _health_counts(cluster, 3, timeout=5)
            planner = cluster.service("planner")
            assert await metric(planner, "laneway_planner_workers") == 3
            await lease.revoke()
            await _health_counts(cluster, 2, timeout=5)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await admin.delete(SCRATCH)
        for client in (attacker, ghost_etcd, admin):
            await client.close()


class _Raced:
    """A client whose first read of a prefix is followed at once by ``between`` (a compaction):
    a watch of that prefix from the revision read then starts behind it."""

    def __init__(self, client: EtcdCluster, between: Callable[[], Awaitable[None]]) -> None:
        self._client = client
        self._between: Callable[[], Awaitable[None]] | None = between

    async def get_prefix(self, prefix: bytes) -> object:
        snapshot = await self._client.get_prefix(prefix)
        if self._between is not None:
            between, self._between = self._between, None
            await between()
        return snapshot

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)


def _raw(key: bytes, value: bytes) -> bytes:
    return value


async def _ghost(cluster: LocalCluster) -> Identity:
    """A new worker identity on the running cluster (as a restarted worker gets), with no
    process: what a worker's credentials can do, without disturbing the cluster's workers."""
    ghost = Identity("worker", "ghost-" + new_id()[:12])
    nats_servers = [s for s in cluster.servers if is_nats(s)]
    await asyncio.to_thread(_auth(cluster).add, ghost, nats_servers, cluster.etcd_endpoints)
    return ghost


@contextlib.asynccontextmanager
async def _reporting(cluster: LocalCluster, worker: Identity) -> AsyncIterator[None]:
    """``worker``'s load reports, every 0.2 s as the cluster's workers send theirs."""
    nc = await _nats_as(cluster, worker)
    report = WorkerLoadReported(
        source=f"worker/{worker.instance}", worker_id=worker.instance, role="both", running=0,
        waiting=0, waiting_prefill_tokens=0, kv_blocks_used=0, kv_blocks_total=10,
    )  # fmt: skip

    async def loop() -> None:
        while True:
            await nc.publish(Subjects.load(worker.instance).subject, encode(report))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.close()


async def _complete(cluster: LocalCluster) -> None:
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=10
    ) as http:
        body = {"model": "laneway-sim", "prompt": "Once", "max_tokens": 4}
        reply = await http.post("/completions", json=body)
    assert reply.status_code == 200, reply.text
