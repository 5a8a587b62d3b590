"""The bus against a real nats-server with JetStream, and the channels' declaration."""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg
from nats.js.api import StorageType
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry

from benchmarks import bus_bench
from bus import channels
from bus.channels import Asked, Consumer, Stream
from bus.client import Bus, at_server
from bus.provision import ensure_streams
from bus.topology import (
    CHANNELS,
    KV,
    KV_EVENTS,
    RETIRED_STREAMS,
    TOKEN_DELTAS,
    Subjects,
    channel_table,
    readme_table,
)
from infra.embedded import EmbeddedServer
from observability.drops import count_drops_in
from schemas.codec import encode
from schemas.events import (
    Envelope,
    Event,
    KvBlocksStored,
    KvCleared,
    KvEvent,
    RouteDecided,
    TokensGenerated,
    TraceContext,
)
from schemas.messages import OverlapQuery, OverlapReply
from tests.bus.servers import Connect
from tests.helpers import eventually, routed
from tests.ingress.helpers import request_spec

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def kv_event(worker: str, seq: int, event_id: str | None = None) -> KvBlocksStored:
    extra = {"event_id": event_id} if event_id else {}
    return KvBlocksStored(source="t", worker_id=worker, seq=seq, block_hashes=(seq,), **extra)


def tokens(text: str = "a", trace: TraceContext | None = None) -> TokensGenerated:
    return TokensGenerated(
        source="t", request_id="r", worker_id="w", index=0, token_ids=(1,), text=text, trace=trace
    )


async def stored(bus: Bus, stream: str, subject: str) -> int:
    info = await bus.nc.jetstream().stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


def test_the_docs_table_is_the_declared_one() -> None:
    assert readme_table(ARCHITECTURE.read_text()) == channel_table(), (
        "regenerate it: python -m bus.topology --readme docs/architecture.md"
    )


def test_every_event_type_travels_on_a_channel() -> None:
    (union, *_) = typing.get_args(Event)
    carried = {t for channel in CHANNELS for t in channel.events}
    assert set(typing.get_args(union)) <= carried


def test_a_topic_narrows_only_to_a_type_its_channel_carries() -> None:
    assert Subjects.all_routes.only(RouteDecided).events == (RouteDecided,)
    with pytest.raises(ValueError, match="carries no"):
        Subjects.all_kv.only(TokensGenerated)
    with pytest.raises(ValueError, match="view over several subjects"):
        _ = Subjects.all_kv.delivery


async def test_durable_consumer_gets_every_event_once_in_order(bus: Bus) -> None:
    got: list[KvEvent] = []
    done = asyncio.Event()

    async def handler(event: KvEvent) -> None:
        got.append(event)
        if len(got) == 3:
            done.set()

    topic = Subjects.kv("busorder")
    for seq in (1, 2, 3):
        await bus.publish(topic, kv_event("busorder", seq))
    await bus.consume(Consumer("t-order", topic), handler)
    await asyncio.wait_for(done.wait(), 5)
    await asyncio.sleep(0.2)
    assert [e.seq for e in got] == [1, 2, 3]


async def test_a_concurrent_consumer_runs_up_to_its_limit_at_once_and_acks_each(
    bus: Bus,
) -> None:
    started: list[int] = []
    release = asyncio.Event()

    async def handler(event: KvEvent) -> None:
        started.append(event.seq)
        await release.wait()

    topic = Subjects.kv("busconc")
    for seq in range(1, 6):
        await bus.publish(topic, kv_event("busconc", seq))
    await bus.consume(Consumer("t-conc", topic), handler, concurrency=3)
    await eventually(lambda: len(started) == 3, message="three handlers never ran at once")
    await asyncio.sleep(0.3)
    assert started == [1, 2, 3]  # in delivery order, and no more than three
    release.set()
    await eventually(lambda: len(started) == 5)

    async def all_acked() -> bool:
        info = await bus.nc.jetstream().consumer_info(KV.name, "t-conc")
        return info.num_ack_pending == 0 and info.num_pending == 0

    await eventually(all_acked, message="the handled messages were not all acked")


def dropped(reason: str) -> float:
    """This process's dropped messages of ``reason`` so far, as a service's metrics show them
    (the log says so only now and then)."""
    registry = CollectorRegistry()
    count_drops_in(registry)
    found = registry.get_sample_value("laneway_bus_dropped_events_total", {"reason": reason})
    return found or 0.0


async def test_a_stray_event_type_is_dropped_and_acked_not_redelivered(bus: Bus) -> None:
    """A durable consumer whose channel does not carry a type acks it unhandled and goes on:
    nothing can wedge it."""
    strays = dropped("stray")
    topic = Subjects.kv("busstray")
    got: list[KvEvent] = []
    await bus.nc.jetstream().publish(topic.subject, encode(tokens()))
    await bus.publish(topic, kv_event("busstray", 1))

    async def handler(event: KvEvent) -> None:
        got.append(event)

    await bus.consume(Consumer("t-stray", topic, ack_wait_s=1.0), handler)

    async def all_acked() -> bool:
        info = await bus.nc.jetstream().consumer_info(KV.name, "t-stray")
        return bool(got) and info.num_ack_pending == 0 and info.num_pending == 0

    await eventually(all_acked)
    await asyncio.sleep(1.5)  # past ack_wait: an unacked stray would come back now
    assert [type(e) for e in got] == [KvBlocksStored]
    assert dropped("stray") == strays + 1


async def test_a_handler_of_one_type_skips_the_others_quietly(bus: Bus) -> None:
    strays = dropped("stray")
    got: list[KvCleared] = []
    topic = Subjects.kv("busonly")

    async def handler(event: KvCleared) -> None:
        got.append(event)

    await bus.subscribe(topic.only(KvCleared), handler)
    await bus.publish(topic, kv_event("busonly", 1))
    await bus.publish(topic, KvCleared(source="t", worker_id="busonly", seq=2))
    await eventually(lambda: bool(got))
    assert [e.seq for e in got] == [2]
    assert dropped("stray") == strays  # not a stray: a type its channel carries


async def test_an_event_naming_another_worker_than_its_subject_is_dropped(bus: Bus) -> None:
    """Only worker X may publish on X's KV subject; an event there that claims to be worker Y's
    could not have come from Y, so no handler sees it (durable, core or replay)."""
    impostors = dropped("impostor")
    topic = Subjects.kv("busimpostor")
    core: list[KvEvent] = []
    durable: list[KvEvent] = []

    async def on_core(event: KvEvent) -> None:
        core.append(event)

    async def on_durable(event: KvEvent) -> None:
        durable.append(event)

    await bus.subscribe(topic, on_core)
    await bus.publish(topic, kv_event("victim", 1))
    await bus.publish(topic, kv_event("busimpostor", 1))
    await bus.consume(Consumer("t-impostor", topic), on_durable)
    await eventually(lambda: bool(core) and bool(durable))
    await asyncio.sleep(0.3)
    assert [e.worker_id for e in core] == [e.worker_id for e in durable] == ["busimpostor"]
    assert dropped("impostor") == impostors + 2  # by the core subscriber and the durable one


def test_only_keyed_subjects_check_their_key_and_every_subject_is_its_channels() -> None:
    event = kv_event("a", 1)
    assert Subjects.all_kv.impostor(event, "lw.kv.a") is None
    assert Subjects.all_kv.impostor(event, "lw.kv.b") is not None
    route = routed("r1", "b", request_spec("i1"))
    assert Subjects.all_routes.impostor(route, "lw.route.b") is None  # no key field declared
    # A consumer delivers what it stored under the subject it was stored under, wherever it
    # delivers it: a route "heard" on a subject of the KV stream did not come from the planner.
    assert Subjects.all_routes.impostor(route, "lw.kv.b") is not None
    assert Subjects.all_kv.impostor(event, "lw.kv.a.b") is not None
    assert KV_EVENTS.key_of("lw.kv.a") == "a"
    assert KV_EVENTS.key_of("lw.load.a") is None


def test_a_keys_subject_is_filled_once_and_the_kept_ones_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channels, "TOPICS_KEPT", 2)
    channel = dataclasses.replace(TOKEN_DELTAS)  # a copy: nothing kept yet
    assert channel.at("i", "w") is channel.at("i", "w")
    assert channel.at("i", "w").subject == "lw.tok.i.w"
    assert channel.at("i").subject == "lw.tok.i.*"
    # Past the bound, subjects are filled in each time, still right.
    assert channel.at("j", "v").subject == "lw.tok.j.v"
    assert channel.at("j", "v") is not channel.at("j", "v")
    with pytest.raises(ValueError):
        channel.at("a", "b", "c")


async def test_republished_event_id_is_deduplicated(bus: Bus) -> None:
    topic = Subjects.kv("busdedup")
    await bus.publish(topic, kv_event("busdedup", 1, "same-id"))
    await bus.publish(topic, kv_event("busdedup", 1, "same-id"))
    await bus.publish(topic, kv_event("busdedup", 2))

    async def both_arrived() -> bool:
        return await stored(bus, KV.name, topic.subject) >= 2

    await eventually(both_arrived)
    assert await stored(bus, KV.name, topic.subject) == 2


async def test_failed_handler_gets_the_event_again(bus: Bus) -> None:
    attempts: list[int] = []
    done = asyncio.Event()

    async def flaky(event: KvEvent) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("transient")
        done.set()

    topic = Subjects.kv("busretry")
    await bus.publish(topic, KvCleared(source="t", worker_id="busretry", seq=1))
    await bus.consume(Consumer("t-retry", topic), flaky)
    await asyncio.wait_for(done.wait(), 10)
    assert len(attempts) == 2


async def test_trace_context_travels_in_headers(bus: Bus) -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    received: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        received.set_result(msg)

    topic = Subjects.tokens("bustrace", "w")
    await bus.nc.subscribe(topic.subject, cb=on_msg)
    await bus.publish(topic, tokens(trace=TraceContext(traceparent=parent)))
    msg = await asyncio.wait_for(received, 5)
    assert msg.headers is not None
    assert msg.headers["traceparent"] == parent
    # A core message has no stream to drop a copy by its id.
    assert "Nats-Msg-Id" not in msg.headers


async def test_a_stored_event_carries_its_id_for_the_streams_deduplication(bus: Bus) -> None:
    received: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        received.set_result(msg)

    topic = Subjects.kv("busid")
    await bus.nc.subscribe(topic.subject, cb=on_msg)
    event = kv_event("busid", 1)
    await bus.publish(topic, event)
    msg = await asyncio.wait_for(received, 5)
    assert msg.headers == {"Nats-Msg-Id": event.event_id}


async def test_token_deltas_reach_a_live_subscriber(bus: Bus) -> None:
    got: list[TokensGenerated] = []
    topic = Subjects.tokens("buslive", "w")

    async def handler(event: TokensGenerated) -> None:
        got.append(event)

    await bus.subscribe(topic, handler)
    await bus.publish(topic, tokens("x"))
    await eventually(lambda: bool(got))
    assert got[0].text == "x"
    with pytest.raises(NotFoundError):  # core delivery: no stream holds them
        await bus.nc.jetstream().find_stream_name_by_subject(topic.subject)


@pytest.mark.nats_only("streams made and deleted through the JetStream API by provisioning")
async def test_a_retired_stream_is_deleted(bus: Bus) -> None:
    js = bus.nc.jetstream()
    await js.add_stream(Stream(RETIRED_STREAMS[0], StorageType.MEMORY, 60.0).config(["busold.>"]))
    await ensure_streams(bus.js)
    with pytest.raises(NotFoundError):
        await js.stream_info(RETIRED_STREAMS[0])


async def test_request_reply(bus: Bus) -> None:
    async def answer(query: OverlapQuery) -> OverlapReply:
        return OverlapReply(overlaps={"w": len(query.block_hashes)}, indexed_blocks=9)

    asked = Asked("lw.query.test", OverlapQuery, OverlapReply)
    await bus.serve(asked, answer, queue="t")
    reply = await bus.request(asked, OverlapQuery(block_hashes=(1, 2)), timeout=2)
    assert reply.overlaps == {"w": 2}


async def test_replicas_starting_together_share_a_queue_consumer(
    bus: Bus, connect_bus: Connect
) -> None:
    """Two replicas create the same durable queue consumer at once (as planners starting
    together do): both must get messages, not whichever created it last."""
    topic = Subjects.kv("busqueue")
    consumer = Consumer("t-queue", topic, queue="t-queue")
    replicas = [await connect_bus(f"replica-{i}") for i in range(2)]
    got: dict[int, int] = {0: 0, 1: 0}

    def handler_of(i: int) -> Callable[[Envelope], Awaitable[None]]:
        async def handler(event: Envelope) -> None:
            got[i] += 1

        return handler

    try:
        await asyncio.gather(*(r.consume(consumer, handler_of(i)) for i, r in enumerate(replicas)))
        for replica in replicas:  # both subscriptions are at the server before the burst
            await at_server(replica.nc)
        for seq in range(1, 41):
            await bus.publish(topic, kv_event("busqueue", seq))
        await eventually(lambda: sum(got.values()) >= 40)
    finally:
        for replica in replicas:
            await replica.close()
    assert sum(got.values()) == 40
    assert got[0] > 0 and got[1] > 0, got


async def test_the_bus_bench_measures_both_paths(nats_server: EmbeddedServer) -> None:
    results = await bus_bench.run(nats_server.url, nats_server.proc.pid, 200, 50, rounds=1)
    cases = {r.case.split(maxsplit=1)[1] for r in results if r.us_per_msg > 0}
    assert {"laneway Bus.subscribe", "laneway Bus.consume", "nats-py raw callback"} <= cases
    assert "laneway" in bus_bench.report(results)
