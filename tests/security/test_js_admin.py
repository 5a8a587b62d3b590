"""Issue 36's critical finding, against a real nats-server with Laneway's users: the JetStream API
each service identity may call is what it needs and nothing more.

The server applies a stream's ``subjects`` and ``republish`` itself, and delivers a consumer's
messages to the subject its create names, past every publish and subscribe permission. With
the kv-indexer's object store grant (``$JS.API.*.*.OBJ_…``) or the planner's stream updates, a
probe read and rewrote every answer. Here every verb of the API is tried with every identity's
credentials, on every stream and on a stream of the attacker's own, and a call that the server
answers is allowed: exactly the calls listed in ``NEEDED`` may be, and the streams are as the
admin made them afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import RePublish, StreamConfig

from bus.client import Bus
from bus.permissions import Identity
from bus.topology import INDEX_SNAPSHOTS, PLANNER_INTAKE, STREAM_SUBJECTS, bucket_stream
from bus.topology import worker_routes as routes_of
from tests.security.provisioned import Provisioned, provisioned_nats

pytestmark = pytest.mark.live

WORKER, INGRESS = Identity("worker", "w1"), Identity("ingress", "i1")
PLANNER, INDEXER = Identity("planner"), Identity("kv-indexer", "x1")
IDENTITIES = (WORKER, INGRESS, PLANNER, INDEXER)
BUCKET = bucket_stream(INDEX_SNAPSHOTS)
STREAMS = (*(s.name for s in STREAM_SUBJECTS), BUCKET, "LW_FORGED")
_API = "$JS.API"

# What each role calls, written out here rather than taken from bus.permissions: the ordered
# replay of the KV stream (its head, an ephemeral consumer) and the index snapshots (read by
# subject; the kv-indexer also purges its old chunks). The ingress and the planners may ask the
# leader of a stream they publish confirmed events into to step down (bus.leaders), and the
# ingress the planners' durable's, no other.
# Workers use no API at all: the admin made their streams and durables.
_READS = {
    f"{_API}.STREAM.INFO.LW_KV",
    f"{_API}.CONSUMER.CREATE.LW_KV",
    f"{_API}.STREAM.INFO.{BUCKET}",
    f"{_API}.STREAM.MSG.GET.{BUCKET}",
}
NEEDED: dict[str, set[str]] = {
    "worker": set(),
    "ingress": {
        f"{_API}.STREAM.LEADER.STEPDOWN.LW_REQUESTS",
        f"{_API}.CONSUMER.LEADER.STEPDOWN.LW_REQUESTS.planner",
    },
    "planner": {
        *_READS,
        f"{_API}.STREAM.LEADER.STEPDOWN.LW_ROUTES",
        f"{_API}.STREAM.LEADER.STEPDOWN.LW_CONTROL",
        # Which server leads its intake (services.planner.intake_gate).
        f"{_API}.CONSUMER.INFO.LW_REQUESTS.planner",
    },
    "kv-indexer": {*_READS, f"{_API}.STREAM.PURGE.{BUCKET}"},
}


def _verbs() -> list[str]:
    """Every JetStream API subject, on every stream, and on every durable of the cluster."""
    durables = [(c.stream.name, c.durable, c.topic.subject) for c in (routes_of("w1"),)]
    durables.append((PLANNER_INTAKE.stream.name, PLANNER_INTAKE.durable, "lw.req.accepted"))
    found = [
        f"{_API}.INFO",
        f"{_API}.STREAM.LIST",
        f"{_API}.STREAM.NAMES",
        f"{_API}.STREAM.TEMPLATE.CREATE.T",
        f"{_API}.ACCOUNT.PURGE.x",
        f"{_API}.META.LEADER.STEPDOWN",
        f"{_API}.SERVER.REMOVE",
    ]
    for stream in STREAMS:
        for verb in (
            "CREATE",
            "UPDATE",
            "DELETE",
            "PURGE",
            "INFO",
            "MSG.GET",
            "MSG.DELETE",
            "SNAPSHOT",
            "RESTORE",
            "LEADER.STEPDOWN",
            "PEER.REMOVE",
        ):
            found.append(f"{_API}.STREAM.{verb}.{stream}")
        found += [
            f"{_API}.DIRECT.GET.{stream}",
            f"{_API}.CONSUMER.CREATE.{stream}",
            f"{_API}.CONSUMER.CREATE.{stream}.c.lw.tok.>",
            f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.c",
            f"{_API}.CONSUMER.LIST.{stream}",
            f"{_API}.CONSUMER.NAMES.{stream}",
        ]
    for stream, durable, subject in durables:
        found += [
            f"{_API}.CONSUMER.CREATE.{stream}.{durable}.{subject}",
            f"{_API}.CONSUMER.CREATE.{stream}.{durable}",
            *(
                f"{_API}.CONSUMER.{verb}.{stream}.{durable}"
                for verb in ("INFO", "DELETE", "MSG.NEXT", "PAUSE", "LEADER.STEPDOWN", "UNPIN")
            ),
        ]
    return found


# A body each verb accepts or refuses without harm where it is allowed (the needed ones).
_BODIES = {
    "MSG.GET": {"last_by_subj": "$O.none"},
    "PURGE": {"filter": "$O.LW_INDEX_SNAPSHOTS.C.none"},
    "CONSUMER.CREATE.LW_KV": {
        "stream_name": "LW_KV",
        "config": {"ack_policy": "none", "deliver_subject": "_i.probe.x", "mem_storage": True},
    },
}


def _body(subject: str) -> bytes:
    for key, body in _BODIES.items():
        if key in subject:
            return json.dumps(body).encode()
    return b""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provisioned]:
    """Of this module's own: a verb that should be refused and is not may destroy what it is
    tried on."""
    with provisioned_nats(tmp_path_factory.mktemp("js-admin"), list(IDENTITIES)) as found:
        yield found


@pytest.fixture
async def admin(server: Provisioned) -> AsyncIterator[NatsClient]:
    nc = await server.admin()
    yield nc
    await nc.close()


async def _answered(nc: NatsClient, subject: str) -> bool:
    """Whether the server answers a request on ``subject`` (an error answer included): a
    refused publish gets none."""
    try:
        await nc.request(subject, _body(subject), timeout=2)
    except nats.errors.TimeoutError:
        return False
    return True


async def _configs(admin: NatsClient) -> dict[str, StreamConfig]:
    js = admin.jetstream()
    return {name: (await js.stream_info(name)).config for name in STREAMS if name != "LW_FORGED"}


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.role)
async def test_every_jetstream_verb_is_refused_but_the_needed(
    server: Provisioned, admin: NatsClient, identity: Identity
) -> None:
    before = await _configs(admin)
    nc = await server.connect(identity)
    try:
        verbs = _verbs()
        answered = await asyncio.gather(*(_answered(nc, verb) for verb in verbs))
    finally:
        await nc.close()
    allowed = {verb for verb, yes in zip(verbs, answered, strict=True) if yes}
    assert allowed == NEEDED[identity.role]
    assert await _configs(admin) == before
    assert "LW_FORGED" not in await admin.jetstream().streams_info()


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.role)
async def test_no_identity_adds_subjects_or_a_republish_to_a_stream(
    server: Provisioned, admin: NatsClient, identity: Identity
) -> None:
    """The probe's attack, as a client library makes it: `lw.tok.>` added to a stream (every
    user's answer read) and a republish into an ingress's token subject (an answer rewritten),
    on every stream; and a stream of its own over the answers."""
    before = await _configs(admin)
    nc = await server.connect(identity)
    js = nc.jetstream(timeout=2)
    attacks: list[Coroutine[Any, Any, object]] = [
        js.add_stream(StreamConfig(name="LW_FORGED", subjects=["lw.tok.>"]))
    ]
    for name, config in before.items():
        taken = StreamConfig.from_response(config.as_dict())
        taken.subjects = [*(config.subjects or []), "lw.tok.>"]
        rewritten = StreamConfig.from_response(config.as_dict())
        rewritten.republish = RePublish(src=">", dest="lw.tok.i1.w2")
        attacks += [js.update_stream(taken), js.update_stream(rewritten), js.delete_stream(name)]
    try:
        outcomes = await asyncio.gather(*attacks, return_exceptions=True)
    finally:
        await nc.close()
    assert all(isinstance(o, nats.errors.TimeoutError) for o in outcomes), outcomes
    assert await _configs(admin) == before


async def test_services_use_what_the_admin_made(server: Provisioned, admin: NatsClient) -> None:
    """The control: the admin made the streams, the bucket and each durable (a worker's, the
    planners'), and a service's bus binds to them without any call it may not make."""
    js = admin.jetstream()
    assert {s.config.name for s in await js.streams_info()} >= set(STREAMS) - {"LW_FORGED"}
    assert (await js.consumer_info("LW_ROUTES", "worker-w1")).config.deliver_subject == (
        "_lw.deliver.worker-w1"
    )
    assert (await js.consumer_info("LW_REQUESTS", "planner")).config.deliver_group == "planner"
    bus = Bus(await server.connect(WORKER))
    try:
        await bus.provision(1, by_admin=True)
    finally:
        await bus.close()
