"""The index's host tier: folded beside the GPU tier, never counted as a GPU hit."""

from __future__ import annotations

from schemas.events import KvBlocksRemoved, KvBlocksStored, KvCleared, KvTier
from services.common.kv_index.index import PrefixIndex


def stored(seq: int, *blocks: int, tier: KvTier = "gpu") -> KvBlocksStored:
    return KvBlocksStored(source="t", worker_id="w", seq=seq, block_hashes=blocks, tier=tier)


def removed(seq: int, *blocks: int, tier: KvTier = "gpu") -> KvBlocksRemoved:
    return KvBlocksRemoved(source="t", worker_id="w", seq=seq, block_hashes=blocks, tier=tier)


def test_offloaded_blocks_continue_a_gpu_prefix_in_the_host_tier() -> None:
    index = PrefixIndex()
    index.apply(stored(1, 1, 2, 3, 4))
    index.apply(removed(2, 3, 4))
    index.apply(stored(3, 3, 4, tier="host"))
    assert index.overlaps([1, 2, 3, 4, 5]) == {"w": 2}
    assert index.host_run("w", [1, 2, 3, 4, 5], 2) == 2
    assert index.host_run("w", [1, 2, 3, 4, 5], 0) == 0
    assert index.workers() == {"w"}
    index.apply(removed(4, 4, tier="host"))
    assert index.host_run("w", [1, 2, 3, 4], 2) == 1


def test_a_host_event_that_arrives_early_keeps_its_tier() -> None:
    index = PrefixIndex()
    index.apply(stored(2, 7, tier="host"))
    index.apply(stored(1, 6))
    assert index.overlaps([6, 7]) == {"w": 1}
    assert index.host_run("w", [6, 7], 1) == 1


def test_clearing_a_worker_drops_both_tiers_and_snapshots_keep_them() -> None:
    index = PrefixIndex()
    index.apply(stored(1, 1))
    index.apply(stored(2, 2, tier="host"))
    restored = PrefixIndex.restore(index.snapshot())
    assert restored.overlaps([1, 2]) == {"w": 1}
    assert restored.host_run("w", [1, 2], 1) == 1
    restored.apply(KvCleared(source="t", worker_id="w", seq=3))
    assert restored.size == 0
    assert restored.host_run("w", [1, 2], 1) == 0


def test_the_overlap_answer_gives_each_worker_its_host_run_after_its_gpu_overlap() -> None:
    index = PrefixIndex()
    index.apply(stored(1, 1, 2))
    index.apply(stored(2, 3, 4, tier="host"))
    other = KvBlocksStored(source="t", worker_id="v", seq=1, block_hashes=(1, 2, 3), tier="host")
    index.apply(other)
    overlaps = index.overlaps([1, 2, 3, 4, 5])
    assert overlaps == {"w": 2}
    # v caches nothing on its GPU: its host tier continues the prompt from its start.
    assert index.host_runs([1, 2, 3, 4, 5], overlaps) == {"w": 2, "v": 3}
    assert index.host_runs([9], index.overlaps([9])) == {}
