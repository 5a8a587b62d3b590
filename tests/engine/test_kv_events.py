"""A step's KV changes as events: neighbours that say one thing go as one event, and folding the
fewer events leaves the index that folding every change would."""

from __future__ import annotations

import random
from typing import Literal

from schemas.codec import decode_event, encode
from schemas.events import CacheWiped, KvChanged, RemovedRun, StoredRun
from services.engine.kv_events import coalesced, continued, kv_changed
from services.engine.protocol import BlocksRemoved, BlocksStored, CacheCleared, KvChange


def fold(changes: list[KvChange]) -> dict[str, set[int]]:
    """What each tier holds after the changes, in order (as the indexer folds them)."""
    tiers: dict[str, set[int]] = {"gpu": set(), "host": set()}
    for change in changes:
        if isinstance(change, BlocksStored):
            tiers[change.tier].update(change.block_hashes)
        elif isinstance(change, BlocksRemoved):
            tiers[change.tier].difference_update(change.block_hashes)
        else:
            tiers = {"gpu": set(), "host": set()}
    return tiers


def test_a_steps_evictions_in_a_row_are_one_removal() -> None:
    changes: list[KvChange] = [
        BlocksRemoved((1, 2)),
        BlocksRemoved((3,)),
        BlocksRemoved((4,), "host"),
        BlocksStored((10, 11), None),
        BlocksStored((20,), 5),
    ]
    assert coalesced(changes) == [
        BlocksRemoved((1, 2, 3)),
        BlocksRemoved((4,), "host"),
        BlocksStored((10, 11), None),
        BlocksStored((20,), 5),
    ]


def test_a_stored_run_joins_only_the_run_it_continues() -> None:
    changes: list[KvChange] = [
        BlocksStored((10, 11), 9),
        BlocksStored((12,), 11),
        BlocksStored((13,), 11),
        BlocksStored((14,), 13, "host"),
    ]
    assert coalesced(changes) == [
        BlocksStored((10, 11, 12), 9),
        BlocksStored((13,), 11),
        BlocksStored((14,), 13, "host"),
    ]


def test_nothing_is_merged_across_a_change_of_another_kind() -> None:
    changes: list[KvChange] = [
        BlocksRemoved((1,)),
        BlocksStored((1,), None),
        BlocksRemoved((1,)),
        CacheCleared(),
        BlocksRemoved((2,)),
    ]
    assert coalesced(changes) == changes


def random_step(rnd: random.Random, before: list[KvChange]) -> list[KvChange]:
    """Up to a dozen changes of a dozen blocks, stored runs often continuing an earlier one."""
    changes: list[KvChange] = []
    for _ in range(rnd.randrange(12)):
        tier: Literal["gpu", "host"] = rnd.choice(("gpu", "host"))
        hashes = tuple(rnd.sample(range(12), rnd.randrange(1, 4)))
        kind = rnd.random()
        if kind < 0.45:
            stored = [c for c in before + changes if isinstance(c, BlocksStored)]
            parent = (
                rnd.choice(stored).block_hashes[-1]
                if stored and rnd.random() < 0.6
                else rnd.choice((None, 0))
            )
            changes.append(BlocksStored(hashes, parent, tier))
        elif kind < 0.95:
            changes.append(BlocksRemoved(hashes, tier))
        else:
            changes.append(CacheCleared())
    return changes


def test_folding_the_merged_changes_leaves_the_same_index() -> None:
    rnd = random.Random(7)
    for _ in range(500):
        changes = random_step(rnd, [])
        merged = coalesced(changes)
        assert fold(merged) == fold(changes)
        assert len(merged) <= len(changes)


def test_a_run_the_next_step_continues_joins_the_held_step() -> None:
    held: list[KvChange] = [BlocksStored((1, 2), None), BlocksStored((7,), 3)]
    out, rest = continued(held, [BlocksStored((4,), 2), BlocksStored((5,), 4), BlocksRemoved((9,))])
    assert out == [BlocksStored((1, 2, 4, 5), None), BlocksStored((7,), 3)]
    assert rest == [BlocksRemoved((9,))]


def test_a_run_does_not_join_past_a_removal_of_its_blocks_or_a_clear() -> None:
    held: list[KvChange] = [BlocksStored((1, 2), None), BlocksRemoved((4,))]
    late: list[KvChange] = [BlocksStored((4,), 2)]
    assert continued(held, late) == (held, late)
    removed_first: list[KvChange] = [BlocksRemoved((4,)), BlocksStored((4,), 2)]
    assert continued(held[:1], removed_first) == (held[:1], removed_first)
    cleared: list[KvChange] = [CacheCleared(), BlocksStored((3,), 2)]
    assert continued(held[:1], cleared) == (held[:1], cleared)


def test_two_steps_joined_leave_the_index_they_would_one_by_one() -> None:
    rnd = random.Random(11)
    joined = 0
    for _ in range(1000):
        first = coalesced(random_step(rnd, []))
        second = coalesced(random_step(rnd, first))
        out, rest = continued(first, second)
        assert fold(out + rest) == fold(first + second)
        assert len(out) == len(first)
        joined += len(second) - len(rest)
    assert joined > 100  # the case it is for came up


def test_a_steps_changes_are_one_event_in_their_order() -> None:
    changes = [BlocksStored((5, 6), 4, "host"), BlocksRemoved((5,)), CacheCleared()]
    event = kv_changed(changes, "w1", 3)
    assert (event.source, event.worker_id, event.seq) == ("worker/w1", "w1", 3)
    stored, removed, cleared = event.changes
    assert isinstance(stored, StoredRun) and isinstance(removed, RemovedRun)
    assert (stored.parent_hash, stored.block_hashes, stored.tier) == (4, (5, 6), "host")
    assert (removed.block_hashes, removed.tier) == ((5,), "gpu")
    assert isinstance(cleared, CacheWiped)
    # Built without validating each change: what validation would have built, on the wire too.
    assert decode_event(encode(event)) == event
    assert KvChanged.model_validate(event.model_dump()) == event
