"""Requests' block tables over the block pool: prefix hits, growth, caching, freeing."""

from __future__ import annotations

from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.request import SimRequest


class KvCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def prefix_hits(self, req: SimRequest) -> tuple[int, int]:
        """Leading cached blocks of a waiting request's tokens, and how many of them are idle.
        The last token is never a hit: the request must compute it to sample the next one."""
        limit = (req.num_tokens - 1) // self.block_size
        return self.pool.count_hits(req.hashes_upto(limit, self.block_size), limit)

    def host_hits(self, req: SimRequest, hits: int) -> int:
        """Blocks after a waiting request's ``hits`` that host memory holds: loaded, not
        computed. The last token is never one, as for GPU hits. They become the most recently
        used there, so that the evictions of its admission push other blocks out first."""
        limit = (req.num_tokens - 1) // self.block_size
        hashes = req.hashes_upto(limit, self.block_size)
        loaded = self.pool.count_host(hashes, hits, limit)
        self.pool.touch_host(hashes[hits : hits + loaded])
        return loaded

    def admit(self, req: SimRequest, hits: int, idle_hits: int, num_new: int) -> bool:
        """Give a waiting request its ``hits`` cached blocks and room for ``num_new`` tokens after
        them; False (and nothing taken) if the pool cannot."""
        pool, bs = self.pool, self.block_size
        new_blocks = -(-(hits * bs + num_new) // bs) - hits
        # Idle hits are counted free but are about to be taken, not reused for new blocks.
        if new_blocks > pool.num_free - idle_hits:
            return False
        cached = req.hashes[:hits]
        pool.take_cached(cached)
        pool.allocate(new_blocks)
        req.blocks = [*cached, *([None] * new_blocks)]
        req.num_offered = hits
        req.num_computed = hits * bs
        return True

    def grow(self, req: SimRequest, num_new: int) -> bool:
        """Room for a running request's next ``num_new`` tokens; False if the pool is short."""
        missing = -(-(req.num_computed + num_new) // self.block_size) - len(req.blocks)
        if missing <= 0:
            return True
        if not self.pool.allocate(missing):
            return False
        req.blocks.extend([None] * missing)
        return True

    def cache_computed(self, req: SimRequest) -> None:
        """Offer the blocks that became full and computed to the prefix cache."""
        full = req.num_computed // self.block_size
        first = req.num_offered
        if full <= first:
            return
        hashes = req.hashes_upto(full, self.block_size)
        parent = hashes[first - 1] if first else None
        became_cached = self.pool.cache(parent, hashes[first:full])
        blocks = req.blocks
        for k, cached in enumerate(became_cached, first):
            if cached:
                blocks[k] = hashes[k]
        req.num_offered = full

    def free(self, req: SimRequest) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_offered = 0
