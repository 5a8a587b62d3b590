"""The attacks of issue 16 on the bus and the store, each against a real NATS and etcd with
Laneway's auth on (users and permissions as `laneway up` makes them): every one is refused.

A worker's own credentials send tokens and terminals to any ingress, but on subjects naming that
worker, and an ingress takes a request's from the worker the planner placed it on alone: a forged
answer to a request on another worker is dropped (the last tests here). What they still allow
(routes to any worker: a prefill worker needs that) is in the threat notes of docs/security.md."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aetcd
import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.client import Bus, at_server
from bus.credentials import Credentials, inbox_prefix
from bus.kv_source import BusSnapshots
from bus.objects import save_object
from bus.permissions import Identity
from bus.provision import ensure_streams
from bus.registry import WORKERS_PREFIX, EtcdCluster, etcd_endpoints, role_key
from bus.sessions import SESSIONS_PREFIX
from bus.topology import (
    INDEX_SNAPSHOT_NAME,
    INDEX_SNAPSHOTS,
    KV,
    REQUESTS,
    ROUTES,
    Subjects,
    worker_routes,
)
from infra.cluster_auth import ClusterAuth, secure
from infra.embedded import EmbeddedServer, start_etcd, start_nats
from schemas.codec import encode
from schemas.events import (
    KvBlocksStored,
    KvEvent,
    RequestAccepted,
    RequestFinished,
    RequestPlaced,
    RouteDecided,
    TokensGenerated,
    Usage,
)
from services.common.kv_follow import restore
from services.common.kv_index.index import PrefixIndex
from services.ingress.follow import Recovery
from services.ingress.nats_gateway import NatsGateway
from tests.helpers import eventually, registration, routed
from tests.ingress.helpers import collect, request_spec

pytestmark = pytest.mark.live

WORKER, OTHER_WORKER = Identity("worker", "w1"), Identity("worker", "w2")
INGRESS, OTHER_INGRESS = Identity("ingress", "i1"), Identity("ingress", "i2")
PLANNER, INDEXER = Identity("planner"), Identity("kv-indexer", "x1")
ADMIN = Identity("admin")


@dataclass
class Secured:
    auth: ClusterAuth
    nats: EmbeddedServer
    etcd: EmbeddedServer
    opened: list[NatsClient] = field(default_factory=list)

    def creds(self, server: str, identity: Identity) -> Credentials:
        return self.auth.credentials(server, identity.user)

    async def nats_as(self, identity: Identity, refusals: list[str] | None = None) -> NatsClient:
        """A connection whose refusals (the server's permission errors) land in ``refusals``."""
        found = refusals if refusals is not None else []

        async def on_error(error: Exception) -> None:
            found.append(str(error))

        nc = await nats.connect(
            self.creds("nats", identity).within(self.nats.url),
            error_cb=on_error,
            allow_reconnect=False,
            inbox_prefix=inbox_prefix(identity.user),
        )
        self.opened.append(nc)
        return nc

    def etcd_as(self, identity: Identity | None) -> EtcdCluster:
        """None: anonymous."""
        creds = self.creds("etcd", identity) if identity is not None else None
        return EtcdCluster(etcd_endpoints(self.etcd.url), failover_s=0.0, credentials=creds)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root: Path = tmp_path_factory.mktemp("secured")
    identities = [WORKER, OTHER_WORKER, INGRESS, OTHER_INGRESS, PLANNER, INDEXER]
    auth = ClusterAuth(root / "auth", identities)
    nats_server = start_nats(root / "nats", authorization=auth.nats_authorization())
    etcd_server = start_etcd(root / "etcd")
    try:
        secure(auth, nats_server.url, etcd_server.url, 1, nats=True, etcd=True)
        yield Secured(auth, nats_server, etcd_server)
    finally:
        nats_server.stop()
        etcd_server.stop()


@pytest.fixture
async def secured(servers: Secured) -> AsyncIterator[Secured]:
    yield servers
    for nc in servers.opened:
        if not nc.is_closed:
            await nc.close()
    servers.opened.clear()


async def _refused(nc: NatsClient, refusals: list[str], subject: str) -> None:
    """The server said no to ``subject`` (its only answer to a refused publish/subscribe)."""
    await at_server(nc)
    await eventually(
        lambda: any("permissions violation" in r.lower() and subject in r for r in refusals),
        timeout=3,
        message=f"no refusal for {subject}",
    )


async def _received(
    secured: Secured, subject: str, publish: NatsClient, data: bytes, expected: bool = False
) -> bool:
    """Whether a message ``publish`` sends on ``subject`` reaches an admin subscriber: waited
    for where ``expected``, else given 0.3 s (the refusal checks say why it did not)."""
    admin = await secured.nats_as(ADMIN)
    got: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        got.append(msg)

    await admin.subscribe(subject, cb=on_msg)
    await at_server(admin)
    await publish.publish(subject, data)
    await at_server(publish)
    if expected:
        await eventually(lambda: bool(got), timeout=20, message=f"nothing on {subject}")
    else:
        await asyncio.sleep(0.3)
    return bool(got)


def _kv(worker: str) -> bytes:
    return encode(KvBlocksStored(source="t", worker_id=worker, seq=1, block_hashes=(1,)))


async def test_an_anonymous_nats_connection_is_refused(secured: Secured) -> None:
    async def quiet(_: Exception) -> None:
        return None

    wrong = Credentials(WORKER.user, "not-its-password").within(secured.nats.url)
    for url in (secured.nats.url, wrong):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, error_cb=quiet)


async def test_a_worker_publishes_its_own_kv_subject_only(secured: Secured) -> None:
    refusals: list[str] = []
    worker = await secured.nats_as(WORKER, refusals)
    assert await _received(secured, Subjects.kv("w1").subject, worker, _kv("w1"), True)
    victim = Subjects.kv("w2").subject
    assert not await _received(secured, victim, worker, _kv("w2"))
    await _refused(worker, refusals, victim)
    # Nor its load report, which the planner routes by.
    assert not await _received(secured, Subjects.load("w2").subject, worker, b"{}")


async def test_only_workers_and_planners_end_requests_and_only_workers_send_tokens(
    secured: Secured,
) -> None:
    """A forged RequestFinished or TokensGenerated to an ingress's subjects, from anyone but
    the roles that serve requests (another ingress here), never arrives."""
    refusals: list[str] = []
    other = await secured.nats_as(OTHER_INGRESS, refusals)
    answers = (Subjects.request_terminal("i1", "w1"), Subjects.tokens("i1", "w1"))
    planners = (Subjects.placements("i1").subject, Subjects.planner_failures("i1").subject)
    for subject in (*(topic.subject for topic in answers), *planners):
        assert not await _received(secured, subject, other, b"{}")
        await _refused(other, refusals, subject)
    indexer = await secured.nats_as(INDEXER, refusals)
    terminal = Subjects.request_terminal("i1", "w1").subject
    assert not await _received(secured, terminal, indexer, b"{}")


async def test_only_the_ingress_cancels(secured: Secured) -> None:
    refusals: list[str] = []
    worker = await secured.nats_as(WORKER, refusals)
    subject = Subjects.cancellation_requested.subject
    assert not await _received(secured, subject, worker, b"{}")
    await _refused(worker, refusals, subject)
    ingress = await secured.nats_as(INGRESS)
    assert await _received(secured, subject, ingress, b"{}", True)


@pytest.mark.parametrize("identity", [WORKER, INGRESS, INDEXER], ids=lambda i: i.role)
async def test_the_prompts_are_read_by_the_planner_alone(
    secured: Secured, identity: Identity
) -> None:
    """Subscribing to `lw.req.accepted`, or a JetStream consumer on the requests stream, gets a
    worker, an ingress or an indexer nothing."""
    refusals: list[str] = []
    spy = await secured.nats_as(identity, refusals)
    seen: list[Msg] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg)

    subject = Subjects.request_accepted.subject
    await spy.subscribe(subject, cb=on_msg)
    await _refused(spy, refusals, subject)
    ingress = await secured.nats_as(INGRESS)
    await ingress.jetstream().publish(subject, b"{}")
    with pytest.raises(nats.errors.TimeoutError):
        await spy.jetstream().add_consumer(REQUESTS.name, durable_name="spy", timeout=0.5)
    await asyncio.sleep(0.3)
    assert seen == []
    planner = await secured.nats_as(PLANNER)
    assert await _received(secured, subject, ingress, b"{}", True)  # the channel works
    assert planner.is_connected


async def test_a_worker_cannot_read_another_workers_routes(secured: Secured) -> None:
    refusals: list[str] = []
    worker = await secured.nats_as(WORKER, refusals)
    js = worker.jetstream()
    theirs = worker_routes("w2")
    with pytest.raises(nats.errors.TimeoutError):
        await js.add_consumer(
            ROUTES.name,
            name=theirs.durable,
            durable_name=theirs.durable,
            filter_subject=theirs.topic.subject,
            deliver_subject="_i.worker-w1.x",
            timeout=0.5,
        )
    # Its own durable under another filter is as refused as an ephemeral one over the stream.
    with pytest.raises(nats.errors.TimeoutError):
        await js.add_consumer(
            ROUTES.name,
            name="worker-w1",
            durable_name="worker-w1",
            filter_subject=theirs.topic.subject,
            deliver_subject="_i.worker-w1.x",
            timeout=0.5,
        )
    with pytest.raises(nats.errors.TimeoutError):
        await js.add_consumer(ROUTES.name, deliver_subject="_i.worker-w1.y", timeout=0.5)
    # Nor another's reply inbox, where its answers come, nor its durable's deliveries.
    await worker.subscribe("_i.worker-w2.>")
    await _refused(worker, refusals, "_i.worker-w2.>")
    await worker.subscribe(theirs.deliver_subject)
    await _refused(worker, refusals, theirs.deliver_subject)


@pytest.mark.parametrize("identity", [WORKER, INGRESS, INDEXER, PLANNER], ids=lambda i: i.role)
async def test_no_service_deletes_or_purges_a_stream(secured: Secured, identity: Identity) -> None:
    refusals: list[str] = []
    js = (await secured.nats_as(identity, refusals)).jetstream(timeout=0.5)
    with pytest.raises(nats.errors.TimeoutError):
        await js.delete_stream(REQUESTS.name)
    with pytest.raises(nats.errors.TimeoutError):
        await js.purge_stream(KV.name)
    assert sum("permissions violation" in r.lower() for r in refusals) == 2
    admin = (await secured.nats_as(ADMIN)).jetstream()
    assert (await admin.stream_info(REQUESTS.name)).config.name == REQUESTS.name


async def test_a_worker_bus_works_within_its_permissions(secured: Secured) -> None:
    """The control: a worker's own bus does what a worker does (confirmed publish, the routes
    of the durable the admin made for it, acked), so the refusals above are the permissions,
    not a broken connection."""
    refusals: list[str] = []
    bus = Bus(await secured.nats_as(WORKER, refusals))
    planner = Bus(await secured.nats_as(PLANNER, refusals))
    try:
        got: list[RouteDecided] = []

        async def on_route(event: RouteDecided) -> None:
            got.append(event)

        await bus.provision(1, by_admin=True)
        await bus.consume(worker_routes("w1"), on_route)
        await bus.publish(
            Subjects.kv("w1"), KvBlocksStored(source="t", worker_id="w1", seq=1, block_hashes=(2,))
        )
        route = routed("control-1", "w1", request_spec("i1"))
        await planner.publish(Subjects.route("w1"), route)
        await eventually(lambda: route in got, message="the route never came")
        assert refusals == []
    finally:
        await bus.close()


async def test_the_planner_folds_the_kv_stream_but_writes_no_snapshot(secured: Secured) -> None:
    """Its own fold of the KV stream: the indexer's snapshot read, the stream replayed after it,
    with no refusal on the way; and the snapshot stays the indexer's to write."""
    index = PrefixIndex()
    index.apply(KvBlocksStored(source="t", worker_id="w1", seq=1, block_hashes=(7, 8)))
    admin = Bus(await secured.nats_as(ADMIN))
    await ensure_streams(admin.js)
    await save_object(admin.js, INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME, index.snapshot(0))
    worker = await secured.nats_as(WORKER)
    await worker.jetstream().publish(Subjects.kv("w1").subject, _kv("w1"))
    refusals: list[str] = []
    planner = Bus(await secured.nats_as(PLANNER, refusals))
    restored = await restore(BusSnapshots(planner))
    assert restored.overlaps((7, 8)) == {"w1": 2}
    folded: list[int] = []

    async def on_kv(event: KvEvent, position: int) -> None:
        folded.append(position)

    await planner.replay(Subjects.all_kv, 0, on_kv)
    await eventually(lambda: bool(folded), message="the planner's replay got nothing")
    assert refusals == []
    with pytest.raises(nats.errors.TimeoutError):
        await save_object(planner.js, INDEX_SNAPSHOTS, INDEX_SNAPSHOT_NAME, b"forged")
    assert (await restore(BusSnapshots(admin))).overlaps((7, 8)) == {"w1": 2}


async def test_an_anonymous_etcd_write_is_refused(secured: Secured) -> None:
    etcd = secured.etcd_as(None)
    try:
        with pytest.raises(aetcd.exceptions.ClientError):
            await etcd.put(
                WORKERS_PREFIX + b"evil", registration("evil").model_dump_json().encode()
            )
        with pytest.raises(aetcd.exceptions.ClientError):
            await etcd.get_prefix(WORKERS_PREFIX)
    finally:
        await etcd.close()


async def test_a_worker_writes_its_own_registration_only(secured: Secured) -> None:
    etcd = secured.etcd_as(WORKER)
    try:
        lease = await etcd.lease(5)
        await etcd.put(
            WORKERS_PREFIX + b"w1", registration("w1").model_dump_json().encode(), lease=lease
        )
        assert await etcd.get(role_key("w1")) is None  # may read its own role
        for key in (WORKERS_PREFIX + b"w2", WORKERS_PREFIX + b"evil"):
            with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                await etcd.put(key, registration(key.decode()[-4:]).model_dump_json().encode())
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await etcd.put(role_key("w1"), b"prefill")  # its role is the planner's to give
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await etcd.put(SESSIONS_PREFIX + b"s", b"w1")
        await lease.revoke()
    finally:
        await etcd.close()


@pytest.mark.parametrize("identity", [INGRESS, INDEXER], ids=lambda i: i.role)
async def test_readers_of_the_workers_cannot_write_one(
    secured: Secured, identity: Identity
) -> None:
    etcd = secured.etcd_as(identity)
    try:
        await etcd.get_prefix(WORKERS_PREFIX)
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await etcd.put(
                WORKERS_PREFIX + b"evil", registration("evil").model_dump_json().encode()
            )
    finally:
        await etcd.close()


async def test_the_planner_keeps_sessions_and_roles_but_no_worker_key(secured: Secured) -> None:
    etcd = secured.etcd_as(PLANNER)
    try:
        await etcd.put(SESSIONS_PREFIX + b"s1", b"w1")
        await etcd.put(role_key("w1"), b"decode")
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await etcd.put(
                WORKERS_PREFIX + b"evil", registration("evil").model_dump_json().encode()
            )
    finally:
        await etcd.close()


async def test_a_worker_answers_under_its_own_name_only(secured: Secured) -> None:
    """Not on another worker's token or terminal subject, not as the planner placing a request,
    and it does not hear the resend queries asked of another worker."""
    refusals: list[str] = []
    worker = await secured.nats_as(WORKER, refusals)
    assert await _received(secured, Subjects.tokens("i1", "w1").subject, worker, b"{}", True)
    theirs = (Subjects.tokens("i1", "w2"), Subjects.request_terminal("i1", "w2"))
    planners = (Subjects.placements("i1").subject, Subjects.planner_failures("i1").subject)
    for subject in (*(topic.subject for topic in theirs), *planners):
        assert not await _received(secured, subject, worker, b"{}")
        await _refused(worker, refusals, subject)
    await worker.subscribe(Subjects.resend("w2").subject)
    await _refused(worker, refusals, Subjects.resend("w2").subject)


async def _bus_as(secured: Secured, identity: Identity) -> Bus:
    return await Bus.connect(secured.creds("nats", identity).within(secured.nats.url), "t")


def _batch(worker: str, index: int, text: str) -> TokensGenerated:
    return TokensGenerated(
        source=f"worker/{worker}",
        request_id="victim",
        worker_id=worker,
        index=index,
        token_ids=tuple(text.encode()),
        text=text,
    )


def _finished(worker: str, tokens: int) -> RequestFinished:
    return RequestFinished(
        source=f"worker/{worker}",
        request_id="victim",
        worker_id=worker,
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=tokens),
        ttft_ms=1.0,
        e2e_ms=2.0,
    )


async def test_a_forged_answer_to_a_request_on_another_worker_is_dropped(
    secured: Secured,
) -> None:
    """The issue's injection: w1's credentials send text and an early end for a request the
    planner placed on w2, first under w1's own name (the ingress drops them), then claiming to
    be w2 on w1's subject (the bus drops them), then on w2's subjects (the server refuses).
    The victim's client gets w2's answer, exactly."""
    planner, ingress = await _bus_as(secured, PLANNER), await _bus_as(secured, INGRESS)
    victim, attacker = await _bus_as(secured, OTHER_WORKER), await _bus_as(secured, WORKER)
    refusals: list[str] = []
    raw = await secured.nats_as(WORKER, refusals)
    try:
        gateway = NatsGateway(ingress, "i1", Recovery(completion_wait_s=0.3))
        await gateway.start()

        async def serve(event: RequestAccepted) -> None:
            placed = RequestPlaced(source="planner/t", request_id="victim", worker_id="w2")
            await planner.publish(Subjects.placements("i1"), placed)
            await at_server(planner.nc)
            await attacker.publish(Subjects.tokens("i1", "w1"), _batch("w1", 0, "EVIL"))
            await attacker.publish(Subjects.request_terminal("i1", "w1"), _finished("w1", 4))
            await attacker.publish(Subjects.tokens("i1", "w1"), _batch("w2", 0, "EVIL"))
            await attacker.publish(Subjects.request_terminal("i1", "w1"), _finished("w2", 4))
            for topic, forged in (
                (Subjects.tokens("i1", "w2"), _batch("w2", 0, "EVIL")),
                (Subjects.request_terminal("i1", "w2"), _finished("w2", 4)),
            ):
                await raw.publish(topic.subject, encode(forged))
                await _refused(raw, refusals, topic.subject)
            await victim.publish(Subjects.tokens("i1", "w2"), _batch("w2", 0, "ab"))
            await victim.publish(Subjects.tokens("i1", "w2"), _batch("w2", 2, "cd"))
            await victim.publish(Subjects.request_terminal("i1", "w2"), _finished("w2", 4))

        await planner.subscribe(Subjects.request_accepted, serve)
        await at_server(planner.nc)
        events = gateway.submit("victim", None, request_spec("i1", max_tokens=4))
        received = await asyncio.wait_for(collect(events), 10)
        assert "".join(e.text for e in received if isinstance(e, TokensGenerated)) == "abcd"
        ended = received[-1]
        assert isinstance(ended, RequestFinished) and ended.worker_id == "w2"
    finally:
        for bus in (planner, ingress, victim, attacker):
            await bus.close()
