"""Snapshots: restore(snapshot()) is the index it was taken of, and folds on the same way."""

from __future__ import annotations

import random

import pytest

from schemas.events import CacheWiped, KvBlocksStored, KvChanged, RemovedRun, StoredRun
from services.common.kv_index.index import PrefixIndex
from tests.kv_indexer import history, replay, scramble, state


def assert_same(restored: PrefixIndex, original: PrefixIndex) -> None:
    assert state(restored) == state(original)
    assert restored.size == original.size
    assert {w: restored.blocks_of(w) for w in original.workers()} == {
        w: original.blocks_of(w) for w in original.workers()
    }


def test_an_empty_index_round_trips() -> None:
    restored = PrefixIndex.restore(PrefixIndex().snapshot())
    assert restored.size == 0
    assert restored.workers() == set()
    assert restored.position == 0


def test_the_position_travels_with_the_snapshot() -> None:
    index = PrefixIndex()
    index.position = 41
    assert PrefixIndex.restore(index.snapshot()).position == 41
    assert PrefixIndex.restore(index.snapshot(position=2**64 - 1)).position == 2**64 - 1


@pytest.mark.parametrize("seed", range(8))
def test_a_restored_index_folds_on_like_one_never_restarted(seed: int) -> None:
    rng = random.Random(seed)
    delivered = scramble(history(rng, workers=6), rng, window=20)
    cut = rng.randrange(len(delivered))
    never_restarted = replay(delivered[:cut])
    # Taken mid-scramble: some events wait in buffers for a gap that fills after the cut.
    restored = PrefixIndex.restore(never_restarted.snapshot(position=cut))
    assert restored.position == cut
    assert_same(restored, never_restarted)
    replay(delivered[cut:], restored)
    replay(delivered[cut:], never_restarted)
    assert_same(restored, never_restarted)
    for w in never_restarted.workers():
        query = sorted(never_restarted.cached(w))
        assert restored.overlaps(query, exact=True) == never_restarted.overlaps(query, exact=True)


def test_buffered_events_survive_a_snapshot() -> None:
    events = [
        KvBlocksStored(source="t", worker_id="a", seq=seq, block_hashes=(seq,)) for seq in (1, 3)
    ]
    restored = PrefixIndex.restore(replay(events).snapshot())
    assert restored.cached("a") == {1}
    restored.apply(KvBlocksStored(source="t", worker_id="a", seq=2, block_hashes=(2,)))
    assert restored.cached("a") == {1, 2, 3}
    restored.apply(events[0])
    assert restored.duplicates == 1


def test_a_buffered_step_keeps_its_changes_in_order() -> None:
    step = (StoredRun(block_hashes=(7, 8)), RemovedRun(block_hashes=(7,)), CacheWiped())
    later = (StoredRun(block_hashes=(9,)), StoredRun(block_hashes=(5,), tier="host"))
    index = PrefixIndex()
    index.apply(KvChanged(source="t", worker_id="a", seq=2, changes=step))
    index.apply(KvChanged(source="t", worker_id="a", seq=3, changes=later))
    restored = PrefixIndex.restore(index.snapshot())
    restored.apply(KvBlocksStored(source="t", worker_id="a", seq=1, block_hashes=(1,)))
    # Stored, removed, then the whole cache cleared, before seq 3's.
    assert restored.cached("a") == {9}
    assert restored.host_run("a", [9, 5], 1) == 1


def test_freed_slots_and_wide_masks_round_trip() -> None:
    index = PrefixIndex()
    for i in range(80):
        index.store(f"w{i}", range(i, 100))
    for i in range(0, 80, 3):
        index.remove_worker(f"w{i}")
    restored = PrefixIndex.restore(index.snapshot())
    assert_same(restored, index)
    restored.store("new", [5])
    index.store("new", [5])
    assert_same(restored, index)
    assert restored.overlaps([5]) == index.overlaps([5])


def test_a_snapshot_costs_about_eight_bytes_a_block() -> None:
    rng = random.Random(3)
    index = PrefixIndex()
    for w in range(16):
        index.store(f"w{w}", [rng.getrandbits(64) for _ in range(5000)])
    assert len(index.snapshot()) < 8 * 80_000 + 4096


def test_damage_is_detected() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3])
    data = index.snapshot()
    flipped = bytearray(data)
    flipped[-1] ^= 1
    for bad in (b"", data[:-8], bytes(flipped), b"XXXX" + data[4:]):
        with pytest.raises(ValueError):
            PrefixIndex.restore(bad)
