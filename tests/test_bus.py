"""The bus against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio

from bus.client import Bus, EventHandler
from bus.topology import KV, Consumer, Subjects
from infra.embedded import EmbeddedServer
from schemas.events import Event, KvBlocksStored, KvCleared, TokensGenerated
from schemas.messages import OverlapQuery, OverlapReply


def kv_event(seq: int, event_id: str | None = None) -> KvBlocksStored:
    extra = {"event_id": event_id} if event_id else {}
    return KvBlocksStored(source="t", worker_id="w1", seq=seq, block_hashes=(seq,), **extra)


async def test_durable_consumer_gets_every_event_once_in_order(bus: Bus) -> None:
    got: list[Event] = []
    done = asyncio.Event()

    async def handler(event: Event) -> None:
        got.append(event)
        if len(got) == 3:
            done.set()

    subject = Subjects.kv("busorder")
    for seq in (1, 2, 3):
        await bus.publish(subject, kv_event(seq))
    await bus.consume(Consumer("t-order", KV, subject), handler)
    await asyncio.wait_for(done.wait(), 5)
    await asyncio.sleep(0.2)
    assert [e.seq for e in got] == [1, 2, 3]  # type: ignore[union-attr]


async def test_republished_event_id_is_deduplicated(bus: Bus) -> None:
    subject = Subjects.kv("busdedup")
    await bus.publish(subject, kv_event(1, "same-id"))
    await bus.publish(subject, kv_event(1, "same-id"))
    info = await bus.nc.jetstream().stream_info(KV.name, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}


async def test_failed_handler_gets_the_event_again(bus: Bus) -> None:
    attempts: list[int] = []
    done = asyncio.Event()

    async def flaky(event: Event) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("transient")
        done.set()

    subject = Subjects.kv("busretry")
    await bus.publish(subject, KvCleared(source="t", worker_id="w", seq=1))
    await bus.consume(Consumer("t-retry", KV, subject), flaky)
    await asyncio.wait_for(done.wait(), 10)
    assert len(attempts) == 2


async def test_trace_context_travels_in_headers(bus: Bus) -> None:
    from schemas.events import TraceContext

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    received = asyncio.get_running_loop().create_future()

    async def on_msg(msg: object) -> None:
        received.set_result(msg)

    subject = Subjects.tokens("bustrace")
    await bus.nc.subscribe(subject, cb=on_msg)
    await bus.publish(
        subject,
        TokensGenerated(
            source="t",
            request_id="r",
            worker_id="w",
            index=0,
            token_ids=(1,),
            text="a",
            trace=TraceContext(traceparent=parent),
        ),
        durable=False,
    )
    msg = await asyncio.wait_for(received, 5)
    assert msg.headers["traceparent"] == parent  # type: ignore[attr-defined]
    assert msg.headers["Nats-Msg-Id"]  # type: ignore[attr-defined]


async def test_request_reply(bus: Bus) -> None:
    async def answer(query: OverlapQuery) -> OverlapReply:
        return OverlapReply(overlaps={"w": len(query.block_hashes)}, indexed_blocks=9)

    await bus.serve("lw.query.test", OverlapQuery, answer, queue="t")
    reply = await bus.request(
        "lw.query.test", OverlapQuery(block_hashes=(1, 2)), OverlapReply, timeout=2
    )
    assert reply.overlaps == {"w": 2}


async def test_replicas_starting_together_share_a_queue_consumer(
    bus: Bus, nats_server: EmbeddedServer
) -> None:
    """Two replicas create the same durable queue consumer at once (as planners starting
    together do): both must get messages, not whichever created it last."""
    subject = Subjects.kv("busqueue")
    consumer = Consumer("t-queue", KV, subject, queue="t-queue")
    replicas = [await Bus.connect(nats_server.url, f"replica-{i}") for i in range(2)]
    got: dict[int, int] = {0: 0, 1: 0}

    def handler_of(i: int) -> EventHandler:
        async def handler(event: Event) -> None:
            got[i] += 1

        return handler

    try:
        await asyncio.gather(*(r.consume(consumer, handler_of(i)) for i, r in enumerate(replicas)))
        for seq in range(1, 41):
            await bus.publish(subject, kv_event(seq))
        deadline = asyncio.get_running_loop().time() + 5
        while sum(got.values()) < 40 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        for replica in replicas:
            await replica.close()
    assert sum(got.values()) == 40
    assert got[0] > 0 and got[1] > 0, got
