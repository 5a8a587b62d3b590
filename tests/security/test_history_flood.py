"""Issue 36's finding 4, against a real nats-server with Laneway's users and streams: a worker's
credentials cannot flush the history of requests and decisions.

A full stream drops its oldest messages, whoever wrote them; before, a worker's terminals went
to LW_REQUESTS and its hand-offs to LW_ROUTES, and 420 × 1 MiB of junk on those subjects left
none of the records before it. Now whatever a worker may publish is stored in streams of the
workers' (LW_OUTCOMES, LW_KV, LW_LOAD): the same junk, each publish also asking the server to
send its acknowledgement onto the history's subjects, leaves every earlier record in place."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bus.client import Bus, at_server
from bus.permissions import Identity
from bus.topology import CONTROL, KV, REQUESTS, ROUTES, Subjects
from schemas.codec import encode
from schemas.messages import OverlapQueries, OverlapQuery, OverlapReplies, OverlapReply
from tests.helpers import eventually
from tests.security.provisioned import Provisioned, provisioned_nats

pytestmark = pytest.mark.live

WORKER, OTHER = Identity("worker", "w1"), Identity("worker", "w2")
INGRESS, PLANNER = Identity("ingress", "i1"), Identity("planner")
INDEXER = Identity("kv-indexer", "x1")
JUNK = b"x" * 1_000_000
# On each subject, more than the largest history stream holds (384 MiB).
FLOOD = 420


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provisioned]:
    with provisioned_nats(
        tmp_path_factory.mktemp("history"), [WORKER, OTHER, INGRESS, PLANNER, INDEXER]
    ) as found:
        yield found


async def _last(admin: NatsClient, stream: str) -> int:
    return int((await admin.jetstream().stream_info(stream)).state.last_seq)


async def _stored(admin: NatsClient, stream: str) -> tuple[int, int]:
    """The stream's first sequence and message count."""
    state = (await admin.jetstream().stream_info(stream)).state
    return state.first_seq, state.messages


async def test_a_worker_cannot_flush_the_requests_and_decisions(server: Provisioned) -> None:
    ingress, planner = await server.connect(INGRESS), await server.connect(PLANNER)
    admin = await server.admin()
    try:
        # The history: requests taken (the ingress) and decided (the planner).
        for i in range(50):
            await ingress.jetstream().publish(Subjects.request_accepted.subject, b"request %d" % i)
            await planner.jetstream().publish(Subjects.route("w2").subject, b"route %d" % i)
        before = {s: await _stored(admin, s) for s in (REQUESTS.name, ROUTES.name)}
        worker = await server.connect(WORKER)
        # Every stored subject a worker may publish to, and the history's own, which it may not;
        # each with its acknowledgement asked onto the history's subjects.
        subjects = [
            Subjects.request_terminal("i1", "w1").subject,
            Subjects.prefilled("w2", "w1").subject,
            Subjects.kv_transferred("w1").subject,
            Subjects.kv("w1").subject,
            Subjects.load("w1").subject,
            Subjects.request_accepted.subject,
            Subjects.route("w2").subject,
            Subjects.planner_failures("i1").subject,
        ]
        replies = [Subjects.cancellation_requested.subject, Subjects.route("w2").subject]
        started = time.monotonic()
        for subject in subjects:
            for i in range(FLOOD):
                await worker.publish(subject, JUNK, reply=replies[i % 2])
                if i % 20 == 0:
                    await worker.flush()
            await worker.flush()
        await worker.close()
        flooded = time.monotonic() - started
        after = {s: await _stored(admin, s) for s in (REQUESTS.name, ROUTES.name)}
        for stream, (first, count) in before.items():
            now_first, now_count = after[stream]
            # Nothing pushed out; at most the server's acknowledgements were added.
            assert now_first == first, f"{stream} lost its oldest records in {flooded:.1f}s"
            assert count <= now_count <= count + FLOOD * len(subjects), stream
    finally:
        for nc in (ingress, planner, admin):
            await nc.close()


async def test_a_service_answers_only_to_an_inbox(server: Provisioned) -> None:
    """The asker names where an answer goes: one named onto the history's subjects would have
    the answering service write there, in its name. A query with such a reply gets no answer;
    one with an inbox does."""
    admin = await server.admin()
    indexer = Bus(await server.connect(INDEXER))
    planner = Bus(await server.connect(PLANNER))
    try:

        async def answer(asked: OverlapQueries) -> OverlapReplies:
            return OverlapReplies(
                replies=tuple(
                    OverlapReply(overlaps={"w1": 1}, indexed_blocks=1) for _ in asked.queries
                )
            )

        await indexer.serve(Subjects.overlap_queries, answer, queue="kv-indexer")
        await at_server(indexer.nc)
        history = (REQUESTS.name, ROUTES.name, CONTROL.name)
        before = {stream: await _stored(admin, stream) for stream in history}
        query = encode(OverlapQueries(queries=(OverlapQuery(block_hashes=(1, 2)),)))
        # The server lets a responder answer each reply subject once.
        for reply in (
            Subjects.cancellation_requested.subject,
            Subjects.request_accepted.subject,
            Subjects.planner_failures("i1").subject,
            Subjects.route("w2").subject,
            Subjects.planner_configured.subject,
        ):
            await planner.nc.publish(Subjects.overlap_queries.subject, query, reply=reply)
        await at_server(planner.nc)
        asked = OverlapQueries(queries=(OverlapQuery(block_hashes=(1,)),))
        answer = await planner.request(Subjects.overlap_queries, asked, timeout=5)
        assert len(answer.replies) == 1
        assert {stream: await _stored(admin, stream) for stream in history} == before
    finally:
        for bus in (indexer, planner):
            await bus.close()
        await admin.close()


async def test_a_workers_acknowledgements_are_sent_nowhere_it_may_not_publish(
    server: Provisioned,
) -> None:
    """Nothing checks a reply subject within one account: each stored publish's acknowledgement
    went where the publisher said, and one worker connection had about 111,000 a second stored
    on ``lw.req.accepted``, emptying ``LW_REQUESTS`` and queueing junk at the planners' durable
    until every request waited a minute. A worker lives in an account of its own
    (bus.accounts): its acknowledgements come back through the server's own reply subjects, and
    the history's subjects never see one, nor does anyone subscribed to them."""
    admin = await server.admin()
    worker = await server.connect(WORKER)
    try:
        history = (REQUESTS.name, ROUTES.name, CONTROL.name)
        before = {stream: await _stored(admin, stream) for stream in history}
        heard: list[str] = []

        async def on_msg(msg: Msg) -> None:
            heard.append(msg.subject)

        for subject in (Subjects.request_accepted.subject, "lw.route.*", "lw.ctl.*"):
            await admin.subscribe(subject, cb=on_msg)
        await at_server(admin)
        first = await _last(admin, KV.name)
        sent = 20_000
        replies = (
            Subjects.request_accepted.subject,
            Subjects.route("w2").subject,
            Subjects.planner_configured.subject,
        )
        for i in range(sent):
            await worker.publish(Subjects.kv("w1").subject, b"x", reply=replies[i % 3])
        await at_server(worker)

        # Every publish stored (each acknowledged), and none of it anywhere else.
        async def all_stored() -> bool:
            return await _last(admin, KV.name) >= first + sent

        await eventually(all_stored, timeout=30, message="the worker's publishes were not stored")
        assert {stream: await _stored(admin, stream) for stream in history} == before
        assert heard == []
        # Its own acknowledgements still come back: a confirmed publish works.
        ack = await worker.jetstream().publish(Subjects.kv("w1").subject, b"y")
        assert ack.stream == KV.name
    finally:
        await worker.close()
        await admin.close()
