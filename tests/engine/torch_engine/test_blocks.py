"""Block ids follow ``sim``'s accounting and imports: after every step each KV cache row is in
exactly one place (free, a cached block, or one running request's private block), and a request's
cached blocks are the rows the cache maps their hashes to."""

from __future__ import annotations

import random

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.engine.protocol import BlocksRemoved, EngineRequest
from services.engine.scheduling.config import SimConfig
from services.engine.scheduling.request import SimRequest
from services.engine.scheduling.scheduler import Scheduler
from services.engine.torch_engine.blocks import PagedBlockPool, PagedKvManager

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def _check(pool: PagedBlockPool, kv: PagedKvManager, running: list[SimRequest]) -> None:
    rows = list(pool._free_ids)  # the pool's own bookkeeping, as nothing else exposes it
    cached = pool.cached_hashes()
    rows += [pool.block_id(h) for h in cached]
    for req in running:
        ids = kv.block_ids(req)
        assert len(ids) == len(req.blocks)
        for ref, block_id in zip(req.blocks, ids, strict=True):
            if ref is None:
                rows.append(block_id)
            else:
                assert ref in cached
                assert block_id == pool.block_id(ref)
    assert sorted(rows) == list(range(NUM_BLOCKS))


def test_every_block_id_is_in_exactly_one_place() -> None:
    rng = random.Random(0)
    pool = PagedBlockPool(NUM_BLOCKS)
    kv = PagedKvManager(pool, BLOCK_SIZE)
    config = SimConfig(BLOCK_SIZE, NUM_BLOCKS, max_num_seqs=5, max_num_batched_tokens=20)
    scheduler = Scheduler(config, kv)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(0, 14))] for _ in range(3)]
    added = 0
    evictions = 0
    while added < 80 or scheduler.running or scheduler.waiting:
        if added < 80 and rng.random() < 0.7:
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randint(1, 6))]
            sampling = SamplingParams(max_tokens=rng.randint(1, 16))
            request = EngineRequest(f"r{added}", tuple(prompt), sampling)
            scheduler.add(SimRequest.from_engine_request(request, BLOCK_SIZE))
            added += 1
        if scheduler.running and rng.random() < 0.05:
            scheduler.abort(rng.choice(scheduler.running))
        if rng.random() < 0.1:
            # Blocks arriving from another engine, as import_kv adds them.
            imported = rng.choice(prefixes) + [rng.randrange(100) for _ in range(8)]
            pool.adopt(chain_block_hashes(imported, BLOCK_SIZE))
        finished = []
        for req, num_new in scheduler.schedule().scheduled:
            req.num_computed += num_new
            kv.cache_computed(req)
            if req.num_computed == req.num_tokens:
                req.append_token(rng.randrange(100))
                if len(req.output) >= req.max_tokens:
                    finished.append(req)
        scheduler.finish(finished)
        evictions += sum(isinstance(c, BlocksRemoved) for c in pool.drain_changes())
        _check(pool, kv, scheduler.running)
    assert scheduler.num_preemptions > 0
    assert evictions > 0
    assert pool.num_used == 0
