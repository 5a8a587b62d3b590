"""The block pool's eviction order under churn: least recently idle first, whatever was taken
and given back in between, and its bookkeeping of that order bounded by the idle blocks."""

from __future__ import annotations

import random
from collections import OrderedDict

from services.engine.protocol import BlocksRemoved
from services.engine.scheduling.block_pool import BlockPool


def _evicted(pool: BlockPool) -> list[int]:
    return [h for c in pool.drain_changes() if isinstance(c, BlocksRemoved) for h in c.block_hashes]


def test_eviction_follows_idle_order_through_churn() -> None:
    rng = random.Random(7)
    pool = BlockPool(num_blocks=600)
    # What the order must be: an idle block goes to the back when released, leaves when taken.
    idle: OrderedDict[int, None] = OrderedDict()
    held: list[list[int]] = []
    next_hash = 1
    for _ in range(20_000):
        if held and (rng.random() < 0.5 or pool.num_free < 8):
            table = held.pop(rng.randrange(len(held)))
            pool.release(table)
            for h in reversed(table):
                if not any(h in t for t in held):
                    idle[h] = None
            continue
        hot = [h for h in list(idle)[:40] if rng.random() < 0.3]  # prefix hits on idle blocks
        fresh = list(range(next_hash, next_hash + rng.randint(1, 5)))
        next_hash += len(fresh)
        pool.take_cached(hot)
        for h in hot:
            del idle[h]
        assert pool.allocate(len(fresh))
        for h in _evicted(pool):
            assert h == next(iter(idle)), "evicted out of order"
            del idle[h]
        assert pool.cache(None, fresh) == [True] * len(fresh)
        pool.drain_changes()
        held.append(hot + fresh)
        assert pool.num_free == pool.num_blocks - pool.num_used
    assert pool.num_used == len({h for t in held for h in t})
    # Every idle block, evicted at once: in the model's order.
    assert pool.allocate(pool.num_free)
    assert _evicted(pool) == list(idle)


def test_order_kept_within_bounds_while_nothing_is_evicted() -> None:
    # A hot prefix taken and given back forever leaves an entry behind each time; none is ever
    # evicted, and what is kept must not grow with the number of requests (a live worker).
    pool = BlockPool(num_blocks=64)
    prefix = [11, 12, 13]
    assert pool.allocate(3)
    pool.cache(None, prefix)
    for _ in range(50_000):
        pool.release(prefix)
        hits, idle = pool.count_hits(prefix, 3)
        assert (hits, idle) == (3, 3)
        pool.take_cached(prefix)
    assert len(pool._order) < 10_000
    assert len(pool._stale) < 10_000  # the places of its stale entries, as bounded
    pool.release(prefix)
    assert pool.allocate(64)
    assert _evicted(pool) == [13, 12, 11]
