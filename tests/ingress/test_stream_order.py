"""A request's tokens reach its client in order and whole: pure tests of the reordering, then the
live gateway against a real nats-server with a worker that publishes out of order."""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from types import AsyncGeneratorType
from typing import Any, cast

import pytest
from nats.aio.msg import Msg

from bus.client import Bus, at_server
from bus.topology import Subjects
from schemas.codec import decode_as, encode
from schemas.events import (
    RequestAccepted,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    RequestSpec,
    TerminalEvent,
    TokenBatch,
    TokenRun,
    TokensGenerated,
)
from schemas.messages import ResendQuery, ResendReply
from services.ingress.follow import Recovery
from services.ingress.gateway import GatewayEvent
from services.ingress.nats_gateway import NatsGateway
from services.ingress.stream_order import StreamOrder, coalesced
from tests.ingress.helpers import WORKER_SOURCE, batch, collect, finished, request_spec, text_of


def replay(order: StreamOrder, arrivals: list[GatewayEvent]) -> list[GatewayEvent]:
    return [event for arrived in arrivals for event in order.take(arrived)]


def test_in_order_events_pass_straight_through() -> None:
    arrivals: list[GatewayEvent] = [batch(0, "a"), batch(1, "bcd"), batch(4, "ef"), finished(6)]
    assert replay(StreamOrder(), arrivals) == arrivals


def test_consecutive_batches_go_out_as_one_and_the_terminal_after_them() -> None:
    end = finished(6)
    out = coalesced([batch(0, "a"), batch(1, "bcd"), batch(4, "ef"), end])
    assert len(out) == 2 and isinstance(out[0], TokensGenerated)
    assert (out[0].index, out[0].token_ids, out[0].text) == (0, tuple(b"abcdef"), "abcdef")
    assert out[1] is end
    alone: list[GatewayEvent] = [batch(0, "a")]
    assert coalesced(alone) == alone


def test_a_terminal_before_the_last_batch_waits_for_it() -> None:
    order = StreamOrder()
    first, last, end = batch(0, "abcd"), batch(4, "ef"), finished(6)
    assert replay(order, [first, end]) == [first]
    assert order.held is end
    assert order.take(last) == [last, end]


def test_batches_go_out_by_index_and_repeats_are_dropped() -> None:
    order = StreamOrder()
    arrivals: list[GatewayEvent] = [
        batch(3, "de"),
        batch(5, "f"),
        batch(3, "de"),
        finished(6),
        batch(0, "abc"),
        batch(0, "abc"),
    ]
    out = replay(order, arrivals)
    assert text_of(out) == "abcdef"
    assert isinstance(out[-1], RequestFinished) and len(out) == 4
    assert order.delivered == 6


def test_no_arrival_order_of_two_chunkings_repeats_or_reorders_a_token() -> None:
    """The same answer published twice, cut otherwise (a batch from each can overlap the other's
    by some tokens), arriving in any order: the client gets a prefix of the answer, never a token
    twice. A batch that starts before the delivered token is dropped whole (its text cannot be cut
    by token), so a gap it leaves is asked for again rather than filled from it."""
    one = [batch(0, "ab"), batch(2, "cd"), batch(4, "ef")]
    other = [batch(0, "a"), batch(1, "bcd"), batch(4, "e"), batch(5, "f")]
    for arrivals in itertools.permutations([*one, *other]):
        text = text_of(replay(StreamOrder(), list(arrivals)))
        assert "abcdef".startswith(text), (arrivals, text)


def test_every_arrival_order_of_one_chunking_and_its_resends_is_the_answer() -> None:
    batches = [batch(0, "a"), batch(1, "bcd"), batch(4, "ef")]
    events: list[GatewayEvent] = [*batches, batches[1], finished(6)]
    for arrivals in itertools.permutations(events):
        out = replay(StreamOrder(), list(arrivals))
        assert text_of(out) == "abcdef" and isinstance(out[-1], RequestFinished), arrivals
        assert len(out) == 4


def test_only_the_first_terminal_counts() -> None:
    order = StreamOrder()
    first, second, tokens = finished(2), finished(0), batch(0, "ab")
    assert replay(order, [first, second, tokens]) == [tokens, first]


@pytest.mark.parametrize(
    "terminal",
    [
        RequestFailed(source=WORKER_SOURCE, request_id="r1", code="engine_error", message="x"),
        RequestCancelled(source=WORKER_SOURCE, request_id="r1", reason="timeout"),
    ],
)
def test_a_terminal_without_tokens_is_not_held(terminal: TerminalEvent) -> None:
    assert StreamOrder().take(terminal) == (terminal,)


def test_giving_up_on_an_answer_with_a_gap_is_an_error() -> None:
    order = StreamOrder()
    replay(order, [batch(0, "ab"), batch(4, "ef"), finished(6)])
    ended = order.give_up("ingress/x")
    assert isinstance(ended, RequestFailed)
    assert ended.code == "incomplete_stream"
    assert ended.completion_tokens == 2
    assert "tokens 2–5" in ended.message


def test_giving_up_on_a_failure_keeps_the_failure() -> None:
    order = StreamOrder()
    failure = RequestFailed(
        source=WORKER_SOURCE, request_id="r1", code="engine_error", message="x", completion_tokens=4
    )
    replay(order, [batch(0, "ab"), failure])
    assert order.give_up("ingress/x") is failure


# The live gateway: a fake worker answers each accepted request with a script of publishes.

Script = list[tuple[str, GatewayEvent]]
INGRESS = "ingress-order"


async def send(bus: Bus, event: GatewayEvent | RequestPlaced) -> None:
    """Publish ``event`` where its sender would: a worker's on its own subjects, the planner's
    (a placement, or a failure naming no worker) on the ingress's placements and failures."""
    if isinstance(event, TokensGenerated):
        await bus.publish(Subjects.tokens(INGRESS, event.worker_id), event)
    elif isinstance(event, RequestPlaced):
        await bus.publish(Subjects.placements(INGRESS), event)
    elif isinstance(event, RequestFailed) and not event.worker_id:
        await bus.publish(Subjects.planner_failures(INGRESS), event)
    else:
        assert event.worker_id
        await bus.publish(Subjects.request_terminal(INGRESS, event.worker_id), event)
    await at_server(bus.nc)


def placed(request_id: str, worker_id: str = "w0", attempt: int = 0) -> RequestPlaced:
    return RequestPlaced(
        source="planner/test", request_id=request_id, worker_id=worker_id, attempt=attempt
    )


async def answer(
    bus: Bus,
    request_id: str,
    script: Script,
    place: bool = True,
    take: Callable[[AsyncIterator[GatewayEvent]], Awaitable[list[GatewayEvent]]] = collect,
) -> list[GatewayEvent]:
    """Submit ``request_id`` and answer it, once accepted, with its placement on w0 (unless not
    ``place``) and ``script``: each token batch or terminal published, flushed, and given time
    to be taken before the next goes out. ``take`` reads the gateway's events (all of them)."""
    gateway = NatsGateway(bus, INGRESS, Recovery(completion_wait_s=0.3))
    await gateway.start()
    accepted = asyncio.Event()

    async def on_accepted(event: RequestAccepted) -> None:
        if event.request_id == request_id:
            accepted.set()

    await bus.subscribe(Subjects.request_accepted, on_accepted)

    async def worker() -> None:
        await accepted.wait()
        if place:
            await send(bus, placed(request_id))
        for kind, event in script:
            assert isinstance(event, TokensGenerated) == (kind == "tokens")
            await send(bus, event)
            await asyncio.sleep(0.05)

    publishing = asyncio.create_task(worker())
    received = await asyncio.wait_for(
        take(gateway.submit(request_id, None, request_spec(INGRESS))), 5
    )
    await publishing
    return received


async def _until_terminal(events: AsyncIterator[GatewayEvent]) -> list[GatewayEvent]:
    """As the ingress's exchange reads: up to the terminal, then the stream is closed."""
    received: list[GatewayEvent] = []
    async for event in events:
        received.append(event)
        if not isinstance(event, TokensGenerated):
            break
    await cast(AsyncGenerator[GatewayEvent, None], events).aclose()
    return received


async def test_a_stream_read_up_to_its_terminal_leaves_no_generator_to_the_finalizer(
    bus: Bus,
) -> None:
    """Left suspended, the gateway's inner generators would be closed by the event loop's
    finalizer of abandoned ones, in a task of its own for every request."""
    first_iter, finalizer = sys.get_asyncgen_hooks()
    abandoned: list[str] = []

    def finalize(generator: AsyncGenerator[Any, Any]) -> None:
        abandoned.append(cast(AsyncGeneratorType[Any, Any], generator).ag_code.co_qualname)
        if finalizer is not None:
            finalizer(generator)

    sys.set_asyncgen_hooks(first_iter, finalize)
    try:
        script: Script = [("tokens", batch(0, "ab", "read")), ("terminal", finished(2, "read"))]
        received = await answer(bus, "read", script, take=_until_terminal)
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(first_iter, finalizer)
    assert text_of(received) == "ab" and isinstance(received[-1], RequestFinished)
    assert abandoned == []


async def test_the_last_batch_overtaken_by_the_terminal_still_reaches_the_client(
    bus: Bus,
) -> None:
    script: Script = [
        ("tokens", batch(0, "ab", "late")),
        ("terminal", finished(6, "late")),
        ("tokens", batch(2, "cd", "late")),
        ("tokens", batch(2, "cd", "late")),
        ("tokens", batch(4, "ef", "late")),
    ]
    received = await answer(bus, "late", script)
    assert text_of(received) == "abcdef"
    assert [type(e).__name__ for e in received][-1] == "RequestFinished"


def at(event: TokensGenerated | RequestFinished, attempt: int) -> GatewayEvent:
    return event.model_copy(update={"attempt": attempt})


async def moved_on(
    bus: Bus, request_id: str, scripts: list[list[GatewayEvent | RequestPlaced]]
) -> tuple[list[GatewayEvent], list[RequestSpec]]:
    """Submit ``request_id`` to an ingress and answer its attempt n, once accepted, with
    ``scripts[n]``; what the client got, and the attempts' specs."""
    gateway = NatsGateway(bus, INGRESS, Recovery(completion_wait_s=0.3))
    await gateway.start()
    attempts: list[RequestSpec] = []
    # The last script's last sleep outlasts the stream: were the test to end first, the bus
    # would drain while the script's flush waits, until that flush times out (10 s).
    scripted = asyncio.Event()

    async def worker(event: RequestAccepted) -> None:
        if event.request_id != request_id:
            return
        attempts.append(event.spec)
        for item in scripts[event.spec.attempt]:
            await send(bus, item)
            await asyncio.sleep(0.05)
        if event.spec.attempt == len(scripts) - 1:
            scripted.set()

    await bus.subscribe(Subjects.request_accepted, worker)
    events = gateway.submit(request_id, None, request_spec(INGRESS))
    received = await asyncio.wait_for(collect(events), 5)
    await asyncio.wait_for(scripted.wait(), 5)
    return received, attempts


async def test_a_batch_that_never_comes_is_made_again_on_the_next_attempt(bus: Bus) -> None:
    """Tokens 2-3 never come and nobody answers for them: the request goes on from "ab" on a
    next attempt, whose answer the client gets; the first attempt's terminal is not passed on."""
    first: list[GatewayEvent | RequestPlaced] = [placed("gap"), batch(0, "ab", "gap")]
    first += [batch(4, "ef", "gap"), finished(6, "gap")]
    second = [placed("gap", attempt=1), at(batch(2, "cdef", "gap"), 1), at(finished(6, "gap"), 1)]
    received, attempts = await moved_on(bus, "gap", [first, second])
    assert text_of(received) == "abcdef"
    ended = received[-1]
    assert isinstance(ended, RequestFinished) and ended.attempt == 1
    assert [a.attempt for a in attempts] == [0, 1]
    assert attempts[1].prompt_token_ids[-2:] == tuple(b"ab")


# Asked again: the holder of a request answers resend queries (lw.resend) with what it kept.


async def test_a_batch_lost_on_its_way_is_sent_again_by_its_holder(bus: Bus) -> None:
    kept = [batch(0, "ab", "resent"), batch(2, "cd", "resent"), batch(4, "ef", "resent")]
    end = finished(6, "resent")
    asked: list[ResendQuery] = []

    async def holder(msg: Msg) -> None:
        query = decode_as(ResendQuery, msg.data)
        asked.append(query)
        batches = tuple(b for b in kept if b.index + len(b.token_ids) > query.index)
        await msg.respond(encode(ResendReply(batches=batches, terminal=end)))

    await bus.subscribe_bytes(Subjects.resend("w0").subject, holder)
    script: Script = [("tokens", kept[0]), ("tokens", kept[2]), ("terminal", end)]
    received = await answer(bus, "resent", script)
    assert text_of(received) == "abcdef"
    assert isinstance(received[-1], RequestFinished)
    assert asked and asked[0].index == 2 and asked[0].request_id == "resent"


async def test_a_request_whose_worker_is_lost_continues_from_the_delivered_tokens(
    bus: Bus,
) -> None:
    """The next attempt starts from the tokens the client has; the old attempt's late events
    are dropped."""
    lost = RequestFailed(
        source=WORKER_SOURCE, request_id="moved", code="worker_lost", message="lease expired"
    )
    first: list[GatewayEvent | RequestPlaced] = [placed("moved"), batch(0, "ab", "moved"), lost]
    second = [
        at(batch(2, "cd", "moved"), 1),  # before its placement: it waits for it
        placed("moved", attempt=1),
        at(batch(2, "zz", "moved"), 0),  # the old worker, back from a stall
        at(batch(4, "ef", "moved"), 1),
        at(finished(6, "moved"), 1),
    ]
    received, attempts = await moved_on(bus, "moved", [first, second])
    assert text_of(received) == "abcdef"
    assert isinstance(received[-1], RequestFinished)
    moved = attempts[-1]
    assert [a.attempt for a in attempts] == [0, 1]
    assert moved.prompt_token_ids == (1, 2, 3, *b"ab")
    assert (moved.sampling.max_tokens, moved.sampling.offset) == (4, 2)


def forged(event: TokensGenerated | RequestFinished) -> GatewayEvent:
    return event.model_copy(update={"worker_id": "w9", "source": "worker/w9"})


async def test_another_workers_tokens_and_terminal_are_dropped(bus: Bus) -> None:
    """Only the worker the planner placed the request on is heard: another one's batches (the
    same index with other text, or the next one) and its early end are dropped, before and
    after the placement came."""
    script: Script = [
        ("tokens", batch(0, "ab", "forged")),
        ("tokens", forged(batch(2, "XX", "forged"))),
        ("terminal", forged(finished(2, "forged"))),
        ("tokens", batch(2, "cd", "forged")),
        ("tokens", forged(batch(4, "YY", "forged"))),
        ("tokens", batch(4, "ef", "forged")),
        ("terminal", finished(6, "forged")),
    ]
    received = await answer(bus, "forged", script)
    assert text_of(received) == "abcdef"
    assert isinstance(received[-1], RequestFinished) and received[-1].worker_id == "w0"


async def test_without_a_placement_no_workers_events_reach_the_client(bus: Bus) -> None:
    """The planner's own failure (naming no worker) is heard without one."""
    script: Script = [
        ("tokens", batch(0, "ab", "unplaced")),
        ("terminal", finished(2, "unplaced")),
        (
            "terminal",
            RequestFailed(
                source="planner/test", request_id="unplaced", code="no_worker", message="none"
            ),
        ),
    ]
    received = await answer(bus, "unplaced", script, place=False)
    assert [type(e).__name__ for e in received] == ["RequestFailed"]


async def test_one_batch_of_a_step_reaches_each_of_its_requests(bus: Bus) -> None:
    """A worker's batch carries a step's tokens for every request of this ingress: each
    request's stream gets its own run, in order, and a run of a request not followed here is
    dropped."""
    gateway = NatsGateway(bus, INGRESS, Recovery(completion_wait_s=0.3))
    await gateway.start()
    texts = {"s1": ("ab", "cd"), "s2": ("xy", "zw")}
    accepted: set[str] = set()
    all_accepted = asyncio.Event()

    async def on_accepted(event: RequestAccepted) -> None:
        accepted.add(event.request_id or "")
        if accepted >= set(texts):
            all_accepted.set()

    await bus.subscribe(Subjects.request_accepted, on_accepted)

    def step(index: int) -> TokenBatch:
        runs = [
            TokenRun(request_id=rid, index=index, token_ids=tuple(t.encode()), text=t)
            for rid, t in [(rid, pair[index // 2]) for rid, pair in texts.items()]
        ]
        gone = TokenRun(request_id="gone", index=index, token_ids=(1,), text="?")
        return TokenBatch(source=WORKER_SOURCE, worker_id="w0", runs=(*runs, gone))

    async def worker() -> None:
        await all_accepted.wait()
        for rid in texts:
            await send(bus, placed(rid))
        for index in (0, 2):
            await bus.publish(Subjects.tokens(INGRESS, "w0"), step(index))
        for rid in texts:
            await send(bus, finished(4, rid))

    publishing = asyncio.create_task(worker())
    streams = [collect(gateway.submit(rid, None, request_spec(INGRESS))) for rid in texts]
    received = await asyncio.wait_for(asyncio.gather(*streams), 5)
    await publishing
    assert [text_of(events) for events in received] == ["abcd", "xyzw"]
    assert all(isinstance(events[-1], RequestFinished) for events in received)


async def test_a_drain_its_request_gave_up_on_leaves_the_ingress_hearing_the_bus(bus: Bus) -> None:
    """A request waiting on a drain is cancelled (its client went) before the server's answer
    to the ping comes: the answer, when it comes, must not stop the connection's reading (as a
    cancelled nats-py flush does), so the next request's answer still arrives whole."""
    gateway = NatsGateway(bus, INGRESS)
    for _ in range(3):
        given_up = asyncio.create_task(gateway.drain())
        await asyncio.sleep(0)
        given_up.cancel()
        await asyncio.gather(given_up, return_exceptions=True)
    await asyncio.wait_for(gateway.drain(), 5)  # answered: the pongs before it came too
    script: Script = [("tokens", batch(0, "ab", "next")), ("terminal", finished(2, "next"))]
    received = await answer(bus, "next", script)
    assert text_of(received) == "ab" and isinstance(received[-1], RequestFinished)
