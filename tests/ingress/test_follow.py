"""One request followed across its attempts when the bus loses and delays messages (a NATS node
that stops answering), pure: a fake queue, resend holder and resubmission. Whatever arrives late,
twice or not at all, the client gets the answer once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from schemas.events import (
    RequestAccepted,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    TokensGenerated,
)
from schemas.messages import ResendReply
from services.ingress.follow import Follow, Heard, Recovery
from services.ingress.gateway import GatewayEvent
from services.ingress.mailbox import Mailbox
from tests.ingress.helpers import batch, collect, finished, request_spec, text_of

FAST = Recovery(completion_wait_s=0.2, silence_s=0.05, orphan_s=0.3, unplaced_s=0.1, unrouted_s=0.3)


def placed(worker_id: str, attempt: int) -> RequestPlaced:
    return RequestPlaced(source="planner/t", request_id="r1", worker_id=worker_id, attempt=attempt)


def tokens_of(events: list[GatewayEvent]) -> list[int]:
    return [i for e in events if isinstance(e, TokensGenerated) for i in e.token_ids]


def of(event: GatewayEvent, worker_id: str, attempt: int) -> GatewayEvent:
    return event.model_copy(update={"worker_id": worker_id, "attempt": attempt})


async def follow(
    on_resubmit: dict[int, list[Heard]],
    unplaced: list[int] | None = None,
    late: Callable[[str], bool] | None = None,
    answers: str = "",
) -> tuple[list[GatewayEvent], list[RequestAccepted]]:
    """Follow request r1 (max_tokens 6) whose holders answer no resend query, but ``answers``
    (that it holds the request, nothing new); each attempt's resubmission puts its events in
    the queue."""
    queue = Mailbox()
    accepted = RequestAccepted(source="ingress/t", request_id="r1", spec=request_spec("t"))
    resubmitted: list[RequestAccepted] = []

    async def resend(_: str, worker: str, index: int, attempt: int) -> ResendReply | None:
        return ResendReply(batches=()) if worker == answers else None

    async def resubmit(moved: RequestAccepted) -> None:
        resubmitted.append(moved)
        for event in on_resubmit.get(moved.spec.attempt, []):
            queue.put_nowait(event)

    for event in on_resubmit.get(0, []):
        queue.put_nowait(event)

    def told() -> None:
        if unplaced is not None:
            unplaced.append(out.attempt)

    out = Follow(accepted, queue, FAST, resend, resubmit, "ingress/t", unplaced=told, late=late)
    return await asyncio.wait_for(collect(out.events()), 5), resubmitted


async def test_a_silent_stream_on_a_late_worker_moves_on_though_the_worker_answers() -> None:
    """w1's reports come late (a congested link): its stream, silent, moves on at once, though
    w1 answers every ask that it holds the request (it would never be orphaned)."""
    first = [placed("w1", 0), of(batch(0, "ab"), "w1", 0)]
    second = [placed("w2", 1), of(batch(2, "cdef"), "w2", 1), of(finished(6), "w2", 1)]
    out, resubmitted = await follow(
        {0: first, 1: second}, late=lambda worker: worker == "w1", answers="w1"
    )
    assert text_of(out) == "abcdef"
    assert [m.spec.avoid_workers for m in resubmitted] == [("w1",)]


async def test_a_request_no_worker_took_up_moves_on_and_its_first_attempt_comes_too_late() -> None:
    """The frozen node held the first attempt's route (and its placement was lost): the request
    was submitted again, and both attempts then ran, the first one's events arriving among the
    second's."""
    late = [
        of(batch(0, "ab"), "w1", 0),
        placed("w1", 0),
        of(batch(2, "cdef"), "w1", 0),
        of(finished(6), "w1", 0),
    ]
    second = [
        of(batch(0, "ab"), "w1", 1),  # before its placement: held for it
        *late,
        placed("w1", 1),
        of(batch(2, "cd"), "w1", 1),
        of(batch(4, "ef"), "w1", 1),
        of(finished(6), "w1", 1),
    ]
    out, resubmitted = await follow({0: [of(batch(0, "a"), "w1", 0)], 1: second})
    assert text_of(out) == "abcdef" and tokens_of(out) == list(b"abcdef")
    assert {e.attempt for e in out} == {1}
    assert [m.spec.attempt for m in resubmitted] == [1]


async def test_a_silent_worker_after_the_first_tokens_continues_from_them_once() -> None:
    """The worker's later batches and terminal were lost and it answers no resend query: the
    next attempt goes on from the two tokens the client has, and the old worker's events that come
    after it (the node thawed) are dropped."""
    first = [placed("w1", 0), of(batch(0, "ab"), "w1", 0)]
    continued = [
        of(batch(2, "cd"), "w1", 0),  # the old attempt, late
        placed("w2", 1),
        of(batch(4, "ef"), "w1", 0),
        of(batch(2, "cd"), "w2", 1),
        of(batch(2, "cd"), "w2", 1),  # twice
        of(finished(6), "w1", 0),
        of(batch(4, "ef"), "w2", 1),
        of(finished(6), "w2", 1),
    ]
    out, resubmitted = await follow({0: first, 1: continued})
    assert text_of(out) == "abcdef" and tokens_of(out) == list(b"abcdef")
    (moved,) = resubmitted
    assert moved.spec.sampling.offset == 2 and moved.spec.prompt_token_ids[-2:] == tuple(b"ab")
    # The planner is told to route it elsewhere: w1 still holds its prompt's KV, and would win.
    assert moved.spec.avoid_workers == ("w1",)


async def test_an_attempt_never_placed_avoids_no_worker() -> None:
    late = [placed("w1", 1), of(batch(0, "abcdef"), "w1", 1), of(finished(6), "w1", 1)]
    _, resubmitted = await follow({0: [], 1: late})
    assert [m.spec.avoid_workers for m in resubmitted] == [()]


async def test_batches_that_came_while_the_client_was_written_to_go_out_as_one() -> None:
    """An ingress that falls behind writes fewer, larger chunks, not a backlog of small ones."""
    arrived = [placed("w1", 0), *(of(batch(i, c), "w1", 0) for i, c in enumerate("abcdef"))]
    out, _ = await follow({0: [*arrived, of(finished(6), "w1", 0)]})
    assert [type(e).__name__ for e in out] == ["TokensGenerated", "RequestFinished"]
    assert tokens_of(out) == list(b"abcdef")


async def test_held_back_a_stream_passes_on_what_came_meanwhile_as_one() -> None:
    """While the loop is busy (a hold), tokens that come after a write go out together at the
    next; without one each batch goes out as it comes."""

    async def run(hold: float) -> list[GatewayEvent]:
        queue = Mailbox()
        accepted = RequestAccepted(source="ingress/t", request_id="r1", spec=request_spec("t"))
        out = Follow(
            accepted, queue, FAST, _no_resend, _no_resubmit, "ingress/t", lambda age_s: hold
        )
        queue.put_nowait(placed("w1", 0))
        queue.put_nowait(of(batch(0, "a"), "w1", 0))

        async def later() -> None:
            for i, c in enumerate("bcdef", start=1):
                await asyncio.sleep(0.005)
                queue.put_nowait(of(batch(i, c), "w1", 0))
            queue.put_nowait(of(finished(6), "w1", 0))

        feeding = asyncio.create_task(later())
        events = await asyncio.wait_for(collect(out.events()), 5)
        await feeding
        return events

    held, not_held = await run(0.2), await run(0.0)
    assert text_of(held) == text_of(not_held) == "abcdef"
    # The first token at once, the rest (and the terminal) together after the hold.
    assert [e.type for e in held] == ["TokensGenerated", "TokensGenerated", "RequestFinished"]
    assert len(not_held) == 7


async def _no_resend(_: str, worker: str, index: int, attempt: int) -> ResendReply | None:
    return None


async def _no_resubmit(moved: RequestAccepted) -> None:
    return None


async def _overtaken(
    late_after_s: float, *, drain_waits: bool, ask_s: float = 0.0
) -> list[GatewayEvent]:
    """Request r1's terminal comes before its batch of tokens 2-5, which reaches the request
    ``late_after_s`` later (None: never); its worker answers no resend query, each taking
    ``ask_s``. ``drain_waits``: the ingress's drain returns only once that batch is in (the
    server's answer to a ping came after it), else at once."""
    queue = Mailbox()
    accepted = RequestAccepted(source="ingress/t", request_id="r1", spec=request_spec("t"))
    came = asyncio.Event()

    async def resend(_: str, worker: str, index: int, attempt: int) -> ResendReply | None:
        await asyncio.sleep(ask_s)
        return None

    async def drain() -> None:
        if drain_waits:
            await came.wait()

    async def later() -> None:
        await asyncio.sleep(late_after_s)
        queue.put_nowait(of(batch(2, "cdef"), "w1", 0))
        came.set()

    for event in (placed("w1", 0), of(batch(0, "ab"), "w1", 0), of(finished(6), "w1", 0)):
        queue.put_nowait(event)
    out = Follow(accepted, queue, FAST, resend, _no_resubmit, "ingress/t", drain=drain)
    feeding = asyncio.create_task(later())
    try:
        return await asyncio.wait_for(collect(out.events()), 5)
    finally:
        feeding.cancel()


async def test_tokens_an_ingress_behind_has_yet_to_read_are_not_declared_lost() -> None:
    """The ingress is seconds behind its socket: the tokens the terminal counts come long after
    the completion wait in wall time, but before the server's answer to a ping sent after the
    terminal; the wait for a resend is counted from then, and the answer is whole."""
    out = await _overtaken(3 * FAST.completion_wait_s, drain_waits=True)
    assert text_of(out) == "abcdef" and isinstance(out[-1], RequestFinished)


async def test_tokens_that_came_during_a_slow_resend_query_are_taken_before_giving_up() -> None:
    out = await _overtaken(0.05, drain_waits=False, ask_s=1.5 * FAST.completion_wait_s)
    assert text_of(out) == "abcdef" and isinstance(out[-1], RequestFinished)


async def test_tokens_lost_on_their_way_continue_on_the_next_attempt_once() -> None:
    """Nothing of them is in the ingress once it drained, and nobody resends them (a link too
    slow to ask across): the answer goes on from the two tokens the client has, and the first
    attempt's batch that comes after is dropped; no error, no answer silently shorter."""
    first = [placed("w1", 0), of(batch(0, "ab"), "w1", 0), of(finished(6), "w1", 0)]
    continued = [
        placed("w2", 1),
        of(batch(2, "cdef"), "w1", 0),  # the lost batch, too late
        of(batch(2, "cdef"), "w2", 1),
        of(finished(6), "w2", 1),
    ]
    out, resubmitted = await follow({0: first, 1: continued})
    assert text_of(out) == "abcdef" and tokens_of(out) == list(b"abcdef")
    assert [e.type for e in out][-1] == "RequestFinished" and {e.attempt for e in out} == {0, 1}
    (moved,) = resubmitted
    assert moved.spec.sampling.offset == 2 and moved.spec.prompt_token_ids[-2:] == tuple(b"ab")


async def test_a_failure_whose_tokens_were_lost_ends_as_it_was() -> None:
    """Only a finished answer goes on elsewhere: a failure that counted tokens nobody resends
    is passed on as it is, once."""
    failed = RequestFailed(
        source="worker/w1",
        request_id="r1",
        code="engine_error",
        message="engine error",
        completion_tokens=6,
    )
    out, resubmitted = await follow(
        {0: [placed("w1", 0), of(batch(0, "ab"), "w1", 0), of(failed, "w1", 0)]}
    )
    assert text_of(out) == "ab" and resubmitted == []
    assert [e.type for e in out] == ["TokensGenerated", "RequestFailed"]


async def test_an_attempt_unplaced_for_long_tells_the_intake_once() -> None:
    """Past ``unplaced_s`` without a placement the intake is told it is late (its leader asked
    to step down), once an attempt; past ``unrouted_s`` the request moves on, and its next
    attempt, placed at once, tells nothing."""
    unplaced: list[int] = []
    second = [placed("w1", 1), of(batch(0, "abcdef"), "w1", 1), of(finished(6), "w1", 1)]
    events, resubmitted = await follow({1: second}, unplaced)
    assert text_of(events) == "abcdef"
    assert len(resubmitted) == 1
    assert unplaced == [0]
