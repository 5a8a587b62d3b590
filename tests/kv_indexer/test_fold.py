"""The fold under at-least-once delivery: duplicates, reordering, lost events."""

from __future__ import annotations

import random

import pytest

from schemas.events import KvBlocksRemoved, KvBlocksStored, KvCleared, KvEvent
from services.common.kv_index.index import PrefixIndex
from tests.kv_indexer import fold, history, replay, scramble, state


def stored(worker: str, seq: int, *blocks: int) -> KvBlocksStored:
    return KvBlocksStored(source="t", worker_id=worker, seq=seq, block_hashes=blocks)


def arrives_early(delivered: list[KvEvent]) -> bool:
    """Whether some event comes before one its worker published earlier: the buffer's case."""
    seen: dict[str, int] = {}
    for event in delivered:
        if event.seq > seen.get(event.worker_id, 0) + 1:
            return True
        seen[event.worker_id] = max(seen.get(event.worker_id, 0), event.seq)
    return False


@pytest.mark.parametrize("seed", range(6))
def test_in_order_fold_matches_the_plain_model(seed: int) -> None:
    events = history(random.Random(seed))
    index = replay(events)
    expected = fold(events)
    assert state(index) == expected
    assert index.size == sum(len(blocks) for blocks in expected.values())
    assert {name: index.blocks_of(name) for name in expected} == {
        name: len(blocks) for name, blocks in expected.items()
    }
    assert index.duplicates == index.gaps == 0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window", [2, 10, 50])
def test_scrambled_delivery_folds_as_in_order(seed: int, window: int) -> None:
    rng = random.Random(seed)
    events = history(rng)
    delivered = scramble(events, rng, window)
    assert arrives_early(delivered)
    index = replay(delivered)
    in_order = replay(events)
    assert state(index) == state(in_order)
    assert index.size == in_order.size
    assert index.duplicates == len(delivered) - len(events)
    assert index.gaps == 0


def test_a_fully_shuffled_history_folds_as_in_order() -> None:
    rng = random.Random(7)
    events = history(rng, events=300)
    delivered = events + events
    rng.shuffle(delivered)
    assert state(replay(delivered)) == fold(events)


def test_an_early_event_waits_for_the_gap_before_it() -> None:
    index = PrefixIndex()
    index.apply(stored("a", 2, 20))
    index.apply(stored("a", 3, 30))
    assert index.size == 0
    index.apply(stored("a", 1, 10))
    assert index.cached("a") == {10, 20, 30}


def test_a_gap_stalls_only_its_own_worker() -> None:
    index = PrefixIndex()
    index.apply(stored("a", 2, 20))
    index.apply(stored("b", 1, 10))
    assert state(index) == {"b": frozenset({10})}


def test_a_lost_event_is_skipped_once_the_buffer_overflows() -> None:
    events = [stored("a", seq, seq) for seq in range(1, 12)]
    index = replay(events[:3] + events[4:9], PrefixIndex(max_pending=5))
    assert index.cached("a") == {1, 2, 3}  # 5 events wait for seq 4
    index.apply(events[9])  # a sixth one: seq 4 is given up
    assert index.gaps == 1
    assert index.cached("a") == {1, 2, 3, *range(5, 11)}
    index.apply(events[3])  # too late: it was skipped
    index.apply(events[10])
    assert index.cached("a") == {1, 2, 3, *range(5, 12)}


def test_overflow_skips_only_the_oldest_gap() -> None:
    index = replay([stored("a", seq, seq) for seq in (1, 3, 4, 6, 7)], PrefixIndex(max_pending=3))
    assert index.cached("a") == {1, 3, 4}
    assert index.gaps == 1
    index.apply(stored("a", 5, 5))
    assert index.cached("a") == {1, 3, 4, 5, 6, 7}


def test_skip_gaps_folds_everything_buffered() -> None:
    index = replay([stored("a", 1, 1), stored("a", 3, 3), stored("a", 5, 5), stored("b", 2, 2)])
    assert index.skip_gaps() == 3
    assert state(index) == {"a": frozenset({1, 3, 5}), "b": frozenset({2})}
    assert index.gaps == 3
    assert index.skip_gaps() == 0


def test_a_duplicate_of_a_buffered_event_is_ignored() -> None:
    index = replay([stored("a", 2, 2), stored("a", 2, 2)])
    assert index.duplicates == 1
    index.apply(stored("a", 1, 1))
    assert index.cached("a") == {1, 2}


def test_a_purged_worker_keeps_its_cursor() -> None:
    index = replay([stored("a", 1, 1), stored("a", 2, 2)])
    index.remove_worker("a")
    assert index.workers() == set()
    index.apply(stored("a", 2, 2))  # redelivered history stays folded
    assert index.size == 0
    index.apply(stored("a", 3, 3))  # the lease lapsed but the worker lives on
    assert state(index) == {"a": frozenset({3})}


def test_clear_then_store_again() -> None:
    index = replay(
        [
            stored("a", 1, 1, 2),
            KvCleared(source="t", worker_id="a", seq=2),
            stored("a", 3, 3),
            KvBlocksRemoved(source="t", worker_id="a", seq=4, block_hashes=(3, 99)),
        ]
    )
    assert index.workers() == set()
    assert index.size == 0


def test_slots_are_reused_and_named_right() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2])
    index.store("b", [1])
    index.remove_worker("a")
    index.store("c", [1, 2, 3])
    assert index.overlaps([1, 2, 3]) == {"b": 1, "c": 3}
    assert index.overlaps([1, 2, 3], exact=True) == {"b": 1, "c": 3}
    assert index.blocks_of("a") == 0
    assert index.blocks_of("c") == 3
    assert index.size == 4


def test_many_workers_need_wide_masks() -> None:
    index = PrefixIndex()
    for i in range(100):
        index.store(f"w{i}", range(i + 1))
    expected = {f"w{i}": i + 1 for i in range(100)}
    assert index.overlaps(range(100)) == expected
    assert index.overlaps(range(100), exact=True) == expected
    assert index.size == 5050
