"""Physical block ids on top of the simulator's block accounting.

``sim``'s pool and manager decide everything (hits, allocation, eviction, caching, freeing), so the
torch engine schedules exactly like ``sim``; the subclasses here only follow those decisions to say
which block of the KV cache tensors each block of each request is.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.request import SimRequest
from services.engine.torch_engine.host_tier import HostKvStore


class PagedBlockPool(BlockPool):
    """``BlockPool`` that also knows which ids are empty and which id each cached hash has, and,
    with a ``host`` store, copies the blocks it evicts there."""

    def __init__(self, num_blocks: int, host: HostKvStore | None = None) -> None:
        super().__init__(num_blocks, host.num_blocks if host is not None else 0)
        self.host = host
        # The ids of the blocks the last eviction took, by hash: their contents stay in the
        # device cache until the blocks are claimed and written, so they can be copied out.
        self._evicted: dict[int, int] = {}
        # The empty blocks' ids, plus, between an ``allocate`` and the ``claim`` that follows it,
        # the ids that allocation took. Reversed so that low ids go first.
        self._free_ids = list(range(num_blocks - 1, -1, -1))
        # Where each cached hash's block lives.
        self._ids: dict[int, int] = {}

    def block_id(self, block_hash: int) -> int:
        return self._ids[block_hash]

    def claim(self, n: int) -> list[int]:
        """Ids of the ``n`` blocks the last ``allocate`` took."""
        ids = self._free_ids
        claimed = ids[len(ids) - n :]
        del ids[len(ids) - n :]
        return claimed

    def register(self, block_hash: int, block_id: int) -> None:
        """``block_id`` became the cached block of ``block_hash``."""
        self._ids[block_hash] = block_id

    def release_ids(self, block_ids: Sequence[int]) -> None:
        """Private blocks given back, whose contents nobody will read again."""
        self._free_ids.extend(block_ids)

    def _evict(self, n: int) -> list[int]:
        evicted = super()._evict(n)
        ids = self._ids
        self._evicted = {h: ids.pop(h) for h in evicted}
        self._free_ids.extend(self._evicted.values())
        return evicted

    def _host_changed(self, added: list[int], dropped: list[int]) -> None:
        assert self.host is not None  # a host tier's changes come only with its store
        gone = set(dropped)
        stored = {h: self._evicted[h] for h in added if h not in gone}
        self.host.offload(stored, dropped)

    def adopt(self, hashes: Sequence[int]) -> tuple[int, list[int]]:
        """Cache blocks whose contents come from elsewhere: ``hashes`` is a chain from the root.
        Blocks already cached are kept; after them, blocks up to the next cached one or until the
        pool is full are allocated and cached (idle, so evictable). Returns the index in
        ``hashes`` of the first new block and the new blocks' ids, for the caller to fill."""
        hits, _ = self.count_hits(hashes, len(hashes))
        # Held while allocating so the allocation cannot evict the prefix the new blocks extend.
        held = list(hashes[:hits])
        self.take_cached(held)
        end = hits
        free = self.num_free
        while end < len(hashes) and end - hits < free and hashes[end] not in self._ids:
            end += 1
        new = list(hashes[hits:end])
        self.allocate(len(new))
        ids = self.claim(len(new))
        self.cache(held[-1] if held else None, new)
        for h, block_id in zip(new, ids, strict=True):
            self._ids[h] = block_id
        self.release([*held, *new])
        return hits, ids


class PagedKvManager(KvCacheManager):
    """``KvCacheManager`` that keeps each running request's block ids beside its block table."""

    def __init__(self, pool: PagedBlockPool, block_size: int) -> None:
        super().__init__(pool, block_size)
        self._paged = pool
        self._ids: dict[SimRequest, list[int]] = {}
        # The host-tier blocks the scheduler just found for a waiting request, read out: loaded
        # into its blocks if it admits the request next.
        self._loading: tuple[SimRequest, tuple[Tensor, Tensor]] | None = None

    def block_ids(self, req: SimRequest) -> list[int]:
        return self._ids[req]

    def host_hits(self, req: SimRequest, hits: int) -> int:
        loaded = super().host_hits(req, hits)
        host = self._paged.host
        if loaded and host is not None:
            self._loading = (req, host.read(req.hashes[hits : hits + loaded]))
        return loaded

    def admit(self, req: SimRequest, hits: int, idle_hits: int, num_new: int) -> bool:
        loading, self._loading = self._loading, None
        if not super().admit(req, hits, idle_hits, num_new):
            return False
        pool = self._paged
        shared = [pool.block_id(h) for h in req.hashes[:hits]]
        ids = self._ids[req] = shared + pool.claim(len(req.blocks) - hits)
        if loading is not None and loading[0] is req:
            # Counted computed from here on: their K and V must be there before the step runs.
            assert pool.host is not None
            blocks = loading[1]
            pool.host.load(blocks, ids[hits : hits + blocks[0].shape[1]])
        return True

    def grow(self, req: SimRequest, num_new: int) -> bool:
        before = len(req.blocks)
        if not super().grow(req, num_new):
            return False
        if len(req.blocks) > before:
            self._ids[req].extend(self._paged.claim(len(req.blocks) - before))
        return True

    def cache_computed(self, req: SimRequest) -> None:
        first = req.num_offered
        super().cache_computed(req)
        ids = self._ids[req]
        for k in range(first, req.num_offered):
            block_hash = req.blocks[k]
            if block_hash is not None:
                self._paged.register(block_hash, ids[k])

    def free(self, req: SimRequest) -> None:
        ids = self._ids.pop(req)
        self._paged.release_ids([i for ref, i in zip(req.blocks, ids, strict=True) if ref is None])
        super().free(req)
