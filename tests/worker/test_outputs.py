"""What a worker publishes of one engine step: one batch per ingress with every request's new
tokens, then the terminals, never before their requests' last tokens."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import cast

import pytest

from bus.client import Bus
from bus.topology import Subjects
from schemas.codec import encode
from schemas.events import (
    KvChanged,
    KvTier,
    RemovedRun,
    RequestCancelled,
    RequestSpec,
    SamplingParams,
    TokenBatch,
    TokenRun,
)
from schemas.kv_events import MAX_KV_CHANGES
from services.engine.protocol import BlocksRemoved, BlocksStored, KvChange
from services.worker.outputs import Background, Outputs
from services.worker.stream import Chunk
from tests.worker.fakes import RecordingBus


def spec(reply_to: str) -> RequestSpec:
    return RequestSpec(
        model="m",
        prompt_token_ids=(1, 2, 3),
        block_size=4,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=8),
        reply_to=reply_to,
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
    )


def ended(request_id: str) -> RequestCancelled:
    return RequestCancelled(source="worker/w1", request_id=request_id, reason="timeout")


async def test_a_step_is_one_batch_per_ingress_and_the_terminals_come_after_it() -> None:
    bus, background = RecordingBus(), Background()
    outputs = Outputs(cast(Bus, bus), "w1", background)
    for request_id in ("a", "b", "c"):
        outputs.kept.started(request_id)
    outputs.tokens(spec("i1"), "a", Chunk(0, (7,), "x"))
    outputs.tokens(spec("i2"), "b", Chunk(4, (8, 9), "yz"))
    outputs.tokens(spec("i1"), "c", Chunk(2, (5,), "w"))
    outputs.terminal("i1", ended("a"))
    await outputs.flush()
    await background.finish()
    subjects = [subject for subject, _ in bus.sent]
    assert subjects == [
        Subjects.tokens("i1", "w1").subject,
        Subjects.tokens("i2", "w1").subject,
        Subjects.request_terminal("i1", "w1").subject,
    ]
    first, second, _ = bus.published
    assert isinstance(first, TokenBatch) and isinstance(second, TokenBatch)
    assert first.worker_id == "w1"
    assert [(r.request_id, r.index, r.token_ids) for r in first.runs] == [
        ("a", 0, (7,)),
        ("c", 2, (5,)),
    ]
    assert [(r.request_id, r.text) for r in second.runs] == [("b", "yz")]
    # Built unvalidated (schemas.trusted), each run is what validation makes of the same values.
    checked = TokenRun(request_id="b", attempt=0, index=4, token_ids=(8, 9), text="yz")
    assert second.runs == (checked,) and encode(second.runs[0]) == encode(checked)
    assert encode(second) == encode(TokenBatch.model_validate_json(encode(second)))
    # What went out is kept for resend queries, as the publisher's own batches.
    reply = outputs.kept.reply("b", 4)
    assert reply is not None and [b.text for b in reply.batches] == ["yz"]


async def test_a_steps_terminals_are_sent_with_its_batches_before_the_connection_writes() -> None:
    """Queued before flush lets the connection's writer run: one write for the step, the
    terminal's confirmation waited for afterwards."""
    bus, background = RecordingBus(), Background()
    outputs = Outputs(cast(Bus, bus), "w1", background)
    outputs.kept.started("a")
    outputs.tokens(spec("i1"), "a", Chunk(0, (7,), "x"))
    outputs.terminal("i1", ended("a"))
    flushing = asyncio.create_task(outputs.flush())
    await asyncio.sleep(0)  # flush runs up to its own yield to the writer
    assert [subject for subject, _ in bus.sent] == [
        Subjects.tokens("i1", "w1").subject,
        Subjects.request_terminal("i1", "w1").subject,
    ]
    await flushing
    await background.finish()


async def test_outputs_of_no_engine_step_go_out_by_themselves() -> None:
    """A hand-off's first token, or a cancellation, comes between steps: nobody flushes it."""
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background())
    outputs.kept.started("a")
    outputs.tokens(spec("i1"), "a", Chunk(0, (7,), "x"))
    outputs.terminal("i1", ended("a"))
    async with asyncio.timeout(1):
        while len(bus.published) < 2:
            await asyncio.sleep(0)
    assert [type(e).__name__ for e in bus.published] == ["TokenBatch", "RequestCancelled"]


async def test_kv_changes_go_a_step_late_joined_to_the_run_the_next_step_continues() -> None:
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background())
    await outputs.kv([BlocksRemoved((1,)), BlocksRemoved((2, 3)), BlocksStored((4, 5), None)])
    assert bus.sent == []  # held: the next step may continue the run
    await outputs.kv([BlocksStored((6,), 5), BlocksRemoved((4,))])
    # The first step's, with the run the second continued, in the worker's order: one event.
    (event,) = cast(list[KvChanged], bus.published)
    assert [(type(c).__name__, c.block_hashes) for c in event.changes] == [
        ("RemovedRun", (1, 2, 3)),
        ("StoredRun", (4, 5, 6)),
    ]
    # The engine ran out of work: what is left goes at once.
    await outputs.idle()
    assert {subject for subject, _ in bus.sent} == {Subjects.kv("w1").subject}
    events = cast(list[KvChanged], bus.published)
    assert [e.seq for e in events] == [1, 2]
    assert events[1].changes == (RemovedRun(block_hashes=(4,)),)
    await outputs.idle()
    assert len(bus.published) == 2


async def test_steps_within_the_kv_interval_go_in_one_event_at_idle() -> None:
    """A request served alone: its steps' changes wait for the engine to run out of work (the
    folds they wake would take a core from its tokens), then go as one event."""
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background(), token_interval_s=0, kv_interval_s=60)
    steps = [
        [BlocksStored((1,), None)],
        [BlocksStored((2,), 1)],
        [BlocksRemoved((7,))],
        [BlocksStored((3,), None)],
        [BlocksRemoved((8,))],
    ]
    for step in steps:
        await outputs.kv(list(step))
    assert bus.published == []  # within the interval: held
    await outputs.idle()
    (event,) = cast(list[KvChanged], bus.published)
    assert [(type(c).__name__, c.block_hashes) for c in event.changes] == [
        ("StoredRun", (1, 2)),
        ("RemovedRun", (7,)),
        ("StoredRun", (3,)),
        ("RemovedRun", (8,)),
    ]
    assert event.seq == 1


async def test_a_busy_worker_s_changes_go_once_the_kv_interval_passed() -> None:
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background(), kv_interval_s=0.05)
    await outputs.kv([BlocksStored((1,), None)])
    await outputs.kv([BlocksRemoved((7,))])  # the first step's is due now: held
    await asyncio.sleep(0.03)
    await outputs.kv([BlocksStored((2,), None)])
    assert bus.published == []
    await asyncio.sleep(0.03)  # the interval since the first was due has passed
    await outputs.kv([BlocksRemoved((8,))])
    (first,) = cast(list[KvChanged], bus.published)
    assert [c.block_hashes for c in first.changes] == [(1,), (7,), (2,)]
    # The interval counts anew from the next change due, not from this event.
    await outputs.kv([BlocksRemoved((9,))])
    assert len(bus.published) == 1
    await outputs.idle()
    assert [c.block_hashes for c in cast(KvChanged, bus.published[1]).changes] == [(8, 9)]


async def test_a_step_of_more_changes_than_an_event_holds_goes_as_several() -> None:
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background())
    # Removals from alternating tiers: nothing coalesces.
    tiers: list[KvTier] = ["gpu", "host"]
    changes: list[KvChange] = [BlocksRemoved((i,), tiers[i % 2]) for i in range(MAX_KV_CHANGES + 3)]
    await outputs.kv(changes)
    await outputs.idle()
    events = cast(list[KvChanged], bus.published)
    assert [(e.seq, len(e.changes)) for e in events] == [(1, MAX_KV_CHANGES), (2, 3)]
    hashes = [c.block_hashes for e in events for c in e.changes]
    assert hashes == [(i,) for i in range(len(changes))]


def _runs(bus: RecordingBus) -> list[list[tuple[str, int, tuple[int, ...], str]]]:
    return [
        [(r.request_id, r.index, r.token_ids, r.text) for r in e.runs]
        for e in bus.published
        if isinstance(e, TokenBatch)
    ]


async def test_steps_faster_than_the_token_interval_go_out_together() -> None:
    """A request's first tokens go at once; the steps after them, within the interval of that
    batch, wait for the next step's and go in its batch; a terminal takes what is held with it."""
    bus, background = RecordingBus(), Background()
    outputs = Outputs(cast(Bus, bus), "w1", background, token_interval_s=60)
    for request_id in ("a", "b"):
        outputs.kept.started(request_id)
    outputs.tokens(spec("i1"), "a", Chunk(0, (1,), "p"))
    await outputs.flush(step_end=True)
    assert _runs(bus) == [[("a", 0, (1,), "p")]]
    outputs.tokens(spec("i1"), "a", Chunk(1, (2,), "q"))
    await outputs.flush(step_end=True)
    await asyncio.sleep(0.01)  # nothing else takes them out meanwhile
    outputs.tokens(spec("i1"), "a", Chunk(2, (3,), "r"))
    outputs.tokens(spec("i2"), "b", Chunk(4, (9,), "z"))  # another ingress: not held by i1's
    await outputs.flush(step_end=True)
    assert _runs(bus)[1:] == [[("b", 4, (9,), "z")]]
    outputs.terminal("i1", ended("a"))
    await outputs.flush(step_end=True)
    await background.finish()
    assert _runs(bus)[2:] == [[("a", 1, (2,), "q"), ("a", 2, (3,), "r")]]
    assert type(bus.published[-1]).__name__ == "RequestCancelled"
    # Kept for resends as the steps made them.
    reply = outputs.kept.reply("a", 1)
    assert reply is not None and [b.text for b in reply.batches] == ["q", "r"]


@pytest.mark.parametrize("then", ["idle", "interval"])
async def test_held_tokens_go_when_the_engine_idles_or_a_step_ends_after_the_interval(
    then: str,
) -> None:
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background(), token_interval_s=0.05)
    outputs.kept.started("a")
    outputs.tokens(spec("i1"), "a", Chunk(0, (1,), "p"))
    await outputs.flush(step_end=True)
    outputs.tokens(spec("i1"), "a", Chunk(1, (2,), "q"))
    await outputs.flush(step_end=True)
    assert len(_runs(bus)) == 1
    if then == "idle":
        await outputs.idle()
        assert _runs(bus)[1:] == [[("a", 1, (2,), "q")]]
    else:
        await asyncio.sleep(0.06)
        outputs.tokens(spec("i1"), "a", Chunk(2, (3,), "r"))
        await outputs.flush(step_end=True)
        assert _runs(bus)[1:] == [[("a", 1, (2,), "q"), ("a", 2, (3,), "r")]]


async def test_without_a_token_interval_every_step_goes_at_its_end() -> None:
    bus = RecordingBus()
    outputs = Outputs(cast(Bus, bus), "w1", Background())
    outputs.kept.started("a")
    for position in range(3):
        outputs.tokens(spec("i1"), "a", Chunk(position, (position,), "x"))
        await outputs.flush(step_end=True)
    assert [len(runs) for runs in _runs(bus)] == [1, 1, 1]
