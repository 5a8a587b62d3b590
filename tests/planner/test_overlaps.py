"""The planner's overlap queries: those of one turn of its loop go in one message, each request
gets its own answer, and a batch the indexer answers wrongly or not at all routes on load alone."""

from __future__ import annotations

import asyncio

from bus.client import Bus
from schemas.messages import OverlapQueries, OverlapReplies, OverlapReply
from tests.planner.helpers import asker, indexer


def answered(batch: OverlapQueries) -> OverlapReplies:
    """Each query's answer names its first block, so a mix-up shows."""
    return OverlapReplies(
        replies=tuple(
            OverlapReply(overlaps={f"w{q.block_hashes[0]}": 1}, indexed_blocks=1)
            for q in batch.queries
        )
    )


async def test_one_turns_queries_go_in_one_message(bus: Bus) -> None:
    asked = await indexer(bus, answered)
    overlaps, _ = asker(bus)
    answers = await asyncio.gather(*(overlaps.ask((n, 100 + n)) for n in range(5)))
    assert answers == [({f"w{n}": 1}, {}) for n in range(5)]
    assert [len(batch.queries) for batch in asked] == [5]
    # One at a time, each goes alone, at once.
    for n in range(2):
        assert await overlaps.ask((n,)) == ({f"w{n}": 1}, {})
    assert [len(batch.queries) for batch in asked] == [5, 1, 1]


async def test_a_batch_answered_short_routes_each_on_load_alone(bus: Bus) -> None:
    await indexer(bus, lambda batch: OverlapReplies(replies=answered(batch).replies[1:]))
    overlaps, failures = asker(bus)
    answers = await asyncio.gather(*(overlaps.ask((n,)) for n in range(3)))
    assert answers == [({}, {})] * 3
    assert failures() == 3


async def test_no_indexer_routes_on_load_alone_after_the_timeout(bus: Bus) -> None:
    overlaps, failures = asker(bus, timeout_s=0.05)
    assert list(await asyncio.gather(overlaps.ask((1,)), overlaps.ask((2,)))) == [({}, {})] * 2
    assert failures() == 2
