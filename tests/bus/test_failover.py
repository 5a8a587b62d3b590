"""Clients over a 3-member etcd and a 3-node JetStream cluster carry on when a member dies; the
servers take only their users, as `laneway up --ha` runs them (an etcd client logs in again on
the member it moves to)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.js.client import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from bus.client import Bus
from bus.permissions import Identity
from bus.provision import ensure_streams
from bus.registry import LeasedKey, connect_etcd, watch_workers
from bus.topology import CANCELS, PLANNER_INTAKE, REQUESTS, STREAM_SUBJECTS
from infra.cluster_auth import ClusterAuth, secure
from infra.embedded import EmbeddedServer, start_etcd_cluster, start_nats_cluster
from schemas.codec import decode_event
from schemas.events import CancellationRequested
from schemas.messages import WorkerRegistration
from tests.helpers import eventually, registration

pytestmark = pytest.mark.live


PLANNER, SURVIVOR, RETURNING = (
    Identity("planner"),
    Identity("worker", "survivor"),
    Identity("worker", "returning"),
)


def _members(
    factory: pytest.TempPathFactory, start: Callable[[Path, Path], list[EmbeddedServer]]
) -> Iterator[list[EmbeddedServer]]:
    path = factory.mktemp("cluster")
    members = start(path, path)
    yield members
    for member in members:
        member.stop()


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory) -> ClusterAuth:
    return ClusterAuth(tmp_path_factory.mktemp("auth"), [PLANNER, SURVIVOR, RETURNING])


@pytest.fixture(scope="module")
def etcd_members(
    tmp_path_factory: pytest.TempPathFactory, auth: ClusterAuth
) -> Iterator[list[EmbeddedServer]]:
    for members in _members(tmp_path_factory, start_etcd_cluster):
        secure(auth, "", ",".join(m.url for m in members), 3, nats=False, etcd=True)
        yield members


@pytest.fixture(scope="module")
def nats_nodes(
    tmp_path_factory: pytest.TempPathFactory, auth: ClusterAuth
) -> Iterator[list[EmbeddedServer]]:
    users = auth.nats_authorization()
    for nodes in _members(tmp_path_factory, lambda d, logs: start_nats_cluster(d, logs, 3, users)):
        for node in nodes:
            node.url = auth.admin("nats").within(node.url)
        yield nodes


def _as(auth: ClusterAuth, identity: Identity, members: list[EmbeddedServer]) -> str:
    return auth.credentials("etcd", identity.user).within(",".join(m.url for m in members))


async def test_etcd_client_moves_to_a_live_member_and_keeps_watch_and_lease(
    etcd_members: list[EmbeddedServer], auth: ClusterAuth
) -> None:
    views: list[set[str]] = []

    async def on_change(workers: dict[str, WorkerRegistration]) -> None:
        views.append(set(workers))

    watcher_client = connect_etcd(_as(auth, PLANNER, etcd_members))
    worker_client = connect_etcd(_as(auth, SURVIVOR, etcd_members))
    watcher = asyncio.create_task(watch_workers(watcher_client, on_change))
    lease = LeasedKey.worker(worker_client, registration("survivor"), ttl_s=5)
    await lease.start()
    await eventually(lambda: views and "survivor" in views[-1])
    seen = len(views)

    # Both clients sit on the first member; it dies, and both move on.
    victim = etcd_members[watcher_client.at]
    victim.kill()
    try:
        assert await worker_client.get(lease.key) is not None  # served by another member
        await asyncio.sleep(6)  # longer than the lease's TTL: its keep-alives went elsewhere
        assert await worker_client.get(lease.key) is not None
        await lease.update(registration("survivor").model_dump_json().encode() + b" ")
        # The re-established watch sees the update, and never a view without the worker.
        await eventually(lambda: len(views) > seen)
        assert all("survivor" in view for view in views[seen - 1 :])
    finally:
        victim.restart()
    watcher.cancel()
    await lease.stop()
    await watcher_client.close()
    await worker_client.close()


async def test_a_lease_lost_while_etcd_was_away_is_taken_again_on_update(
    etcd_members: list[EmbeddedServer], auth: ClusterAuth
) -> None:
    client = connect_etcd(_as(auth, RETURNING, etcd_members))
    lease = LeasedKey.worker(client, registration("returning"), ttl_s=5)
    await lease.start()
    assert lease._lease is not None
    await client.revoke_lease(lease._lease.id)  # what etcd does to a lease not kept alive
    assert await client.get(lease.key) is None
    await lease.update(registration("returning").model_dump_json().encode())
    assert await client.get(lease.key) is not None
    await lease.stop()
    await client.close()


async def test_bus_over_a_cluster_replicates_streams_and_survives_its_server(
    nats_nodes: list[EmbeddedServer],
) -> None:
    bus = await Bus.connect(",".join(node.url for node in nats_nodes), "failover")
    await ensure_streams(bus.js, 1)
    await ensure_streams(bus.js, 3)  # the streams made with one replica move to three
    js = bus.nc.jetstream()
    for stream in STREAM_SUBJECTS:
        assert (await js.stream_info(stream.name)).config.num_replicas == 3

    async def replicated() -> bool:
        infos = [await js.stream_info(stream.name) for stream in STREAM_SUBJECTS]
        return all(
            i.cluster
            and i.cluster.leader
            and all(p.current for p in i.cluster.replicas or [])
            and len(i.cluster.replicas or []) == 2
            for i in infos
        )

    await eventually(replicated, timeout=20, message="streams never got 3 current replicas")
    victim = next(node for node in nats_nodes if node.port == _port(bus))
    victim.kill()
    try:
        # Confirmed: each returns once the stream (its leader elsewhere by then) stored it.
        sent = [f"r{i}" for i in range(5)]
        for request_id in sent:
            await bus.publish(CANCELS.subject, _cancel(request_id))
        # Stored once each, whatever was published again.
        readers: list[JetStreamContext.PullSubscription] = []
        stored: list[str | None] = []

        async def all_read() -> bool:
            # The stream's and the consumer's raft groups may still be electing after the kill
            # (no answer, or 503 from a consumer with no leader yet): ask again.
            with contextlib.suppress(nats.errors.TimeoutError, ServiceUnavailableError):
                if not readers:
                    subject = CANCELS.subject.subject
                    readers.append(await js.pull_subscribe(subject, stream=REQUESTS.name))
                batch = await readers[0].fetch(len(sent) - len(stored), timeout=2)
                stored.extend(decode_event(m.data).request_id for m in batch)
            return len(stored) >= len(sent)

        await eventually(all_read, timeout=30, message="the stored requests never came back")
        assert stored == sent
        info = await js.stream_info(REQUESTS.name, subjects_filter=CANCELS.subject.subject)
        assert info.state.subjects == {CANCELS.subject.subject: len(sent)}
        assert _port(bus) != victim.port
    finally:
        victim.restart()
    await bus.close()


def _cancel(request_id: str) -> CancellationRequested:
    return CancellationRequested(source="test/failover", request_id=request_id, reason="timeout")


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped by a signal (state T in /proc); one that ended meanwhile
    runs no more either."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "T":
            return False
    return True


def _port(bus: Bus) -> int | None:
    return bus.nc.connected_url.port if bus.nc.connected_url else None


async def test_bus_leaves_a_server_that_stops_answering(nats_nodes: list[EmbeddedServer]) -> None:
    bus = await Bus.connect(",".join(node.url for node in nats_nodes), "frozen")

    async def streams_answer() -> bool:
        try:
            await ensure_streams(bus.js, 3)
        except nats.errors.TimeoutError:  # the server the last test restarted: still electing
            return False
        return True

    await eventually(streams_answer, timeout=30.0, message="the cluster's streams never answered")
    victim = next(node for node in nats_nodes if node.port == _port(bus))
    victim.proc.send_signal(signal.SIGSTOP)  # a partitioned server: up, but silent
    # The kernel stops each of its threads as it gets to them: one still running could take the
    # publish below and answer it (seen once on a loaded machine).
    await eventually(lambda: _stopped(victim.proc.pid), message="the server never stopped")
    started = time.monotonic()
    try:
        await bus.publish(CANCELS.subject, _cancel("after-freeze"))
        assert _port(bus) != victim.port
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    print(f"confirmed {time.monotonic() - started:.1f} s after its server froze")
    await bus.close()


async def test_a_planner_tells_whether_its_own_server_leads_its_intake(
    nats_nodes: list[EmbeddedServer], auth: ClusterAuth
) -> None:
    """With its own rights alone (services.planner.intake_gate asks before leaving); asked
    again while the durable's leader is being elected (an earlier test restarted a server)."""
    admin = await Bus.connect(",".join(node.url for node in nats_nodes), "intake-admin")
    planners = [
        await Bus.connect(
            auth.credentials("nats", PLANNER.user).within(f"nats://127.0.0.1:{node.port}"),
            f"intake-{i}",
        )
        for i, node in enumerate(nats_nodes)
    ]
    try:
        await ensure_streams(admin.js, replicas=3)  # the intake's durable too

        async def told() -> bool:
            try:
                info = await admin.js.consumer_info(REQUESTS.name, PLANNER_INTAKE.durable)
            except nats.errors.Error:  # 503, or no answer, while its raft group elects
                return False
            leader = info.cluster.leader if info.cluster is not None else None
            answers = [await p.leads_here(PLANNER_INTAKE) for p in planners]
            return leader is not None and answers == [
                f"nats-{i}" == leader for i in range(len(planners))
            ]

        await eventually(told, timeout=20, message="each planner's answer is not its server's")
    finally:
        for bus in (admin, *planners):
            await bus.close()
