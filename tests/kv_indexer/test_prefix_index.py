from __future__ import annotations

from schemas.block_hash import chain_block_hashes
from schemas.events import KvBlocksRemoved, KvBlocksStored, KvCleared
from services.common.kv_index.index import PrefixIndex


def stored(worker: str, hashes: tuple[int, ...], seq: int = 1) -> KvBlocksStored:
    return KvBlocksStored(source="t", worker_id=worker, seq=seq, block_hashes=hashes)


def test_overlap_counts_leading_blocks_per_worker() -> None:
    prompt = chain_block_hashes(list(range(64)), 16)  # 4 blocks
    index = PrefixIndex()
    index.apply(stored("a", prompt[:3]))
    index.apply(stored("b", prompt[:1]))
    index.apply(stored("c", prompt[1:]))  # holds later blocks but not the first
    assert index.overlaps(prompt) == {"a": 3, "b": 1}
    assert index.size == 7


def test_removal_and_clear_fold_correctly() -> None:
    prompt = chain_block_hashes(list(range(48)), 16)
    index = PrefixIndex()
    index.apply(stored("a", prompt))
    index.apply(stored("b", prompt))
    index.apply(KvBlocksRemoved(source="t", worker_id="a", seq=2, block_hashes=prompt[1:2]))
    assert index.overlaps(prompt) == {"a": 1, "b": 3}
    index.apply(KvCleared(source="t", worker_id="b", seq=2))
    assert index.overlaps(prompt) == {"a": 1}
    assert index.workers() == {"a"}


def test_applying_an_event_twice_is_harmless() -> None:
    prompt = chain_block_hashes(list(range(32)), 16)
    once, twice = PrefixIndex(), PrefixIndex()
    event = stored("a", prompt)
    once.apply(event)
    twice.apply(event)
    twice.apply(event)
    assert once.cached("a") == twice.cached("a")
    assert once.size == twice.size == 2


def test_removing_a_worker_forgets_all_its_blocks() -> None:
    prompt = chain_block_hashes(list(range(32)), 16)
    index = PrefixIndex()
    index.apply(stored("a", prompt))
    index.remove_worker("a")
    assert index.overlaps(prompt) == {}
    assert index.size == 0


def test_blocks_are_counted_per_worker() -> None:
    prompt = chain_block_hashes(list(range(64)), 16)
    index = PrefixIndex()
    index.apply(stored("a", prompt))
    index.apply(stored("b", prompt[:2]))
    index.apply(KvBlocksRemoved(source="t", worker_id="a", seq=2, block_hashes=prompt[3:]))
    assert (index.blocks_of("a"), index.blocks_of("b"), index.blocks_of("c")) == (3, 2, 0)
    assert index.size == 5
    assert index.cached("b") == frozenset(prompt[:2])


def test_events_of_a_purged_worker_still_fold() -> None:
    # A lapsed lease need not mean a dead worker: whether to trust it is the service's call.
    prompt = chain_block_hashes(list(range(32)), 16)
    index = PrefixIndex()
    index.apply(stored("a", prompt[:1]))
    index.remove_worker("a")
    index.apply(stored("a", prompt[1:], seq=2))
    assert index.cached("a") == {prompt[1]}
