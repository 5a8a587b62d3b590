"""The sim engine's host-memory KV tier: evicted blocks go to a host LRU, and a hit there is
loaded at the PCIe link's cost instead of being computed again."""

from __future__ import annotations

from services.engine.protocol import BlocksRemoved, BlocksStored, StepResult
from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.request import SimRequest
from services.engine.sim import FixedPerf, SimConfig, SimEngine
from tests.engine._sim_support import make_request, run_to_end


def test_evicted_blocks_go_to_host_memory_and_its_lru_drops_the_oldest() -> None:
    pool = BlockPool(num_blocks=2, host_blocks=2)
    pool.allocate(2)
    pool.cache(None, [1, 2])
    pool.release([1, 2])
    pool.drain_changes()
    assert pool.allocate(2)
    # Released tail first, so block 2 is the older idle one and leaves first.
    assert pool.drain_changes() == [BlocksRemoved((2, 1)), BlocksStored((2, 1), None, "host")]
    assert pool.count_host([1, 2, 3], 0, 3) == 2
    pool.release([None, None])
    pool.allocate(1)
    pool.cache(None, [3])
    pool.release([3])
    assert pool.allocate(2)
    changes = pool.drain_changes()
    assert BlocksStored((3,), None, "host") in changes
    assert BlocksRemoved((2,), "host") in changes  # the least recently used host block
    assert pool.count_host([1, 3], 0, 2) == 2


def test_without_a_host_tier_evicted_blocks_are_gone() -> None:
    pool = BlockPool(num_blocks=2)
    pool.allocate(2)
    pool.cache(None, [1, 2])
    pool.release([1, 2])
    pool.allocate(2)
    assert pool.count_host([1, 2], 0, 2) == 0
    assert all(change.tier == "gpu" for change in pool.drain_changes())  # type: ignore[union-attr]


def _engine(host_blocks: int) -> SimEngine:
    config = SimConfig(
        block_size=4,
        num_gpu_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        perf_model="fixed",
        num_host_blocks=host_blocks,
        host_link_gb_s=1.0,
        host_link_latency_ms=0.0,
        kv_bytes_per_token=1000,
    )
    return SimEngine(config, FixedPerf())


def _second_visit(host_blocks: int) -> list[StepResult]:
    """A 24-token prompt, another prompt that evicts it, then the first prompt again."""
    engine = _engine(host_blocks)
    first = list(range(1, 25))
    for i, prompt in enumerate([first, list(range(100, 124)), [*first, 99]]):
        engine.add_request(make_request(f"r{i}", prompt, max_tokens=1))
        results = run_to_end(engine)
    return results


def test_a_host_hit_is_loaded_at_the_links_cost_instead_of_computed() -> None:
    loaded, recomputed = _second_visit(host_blocks=16), _second_visit(host_blocks=0)
    # The second prompt evicted the first one's 4 tail blocks (freed tail first); the head's 2
    # stayed on the GPU. With a host tier the 4 come back from it: only the last token computes.
    assert loaded[0].outputs[0].cached_tokens == 24
    assert loaded[0].prefill_tokens == 1
    assert recomputed[0].outputs[0].cached_tokens == 8
    assert recomputed[0].prefill_tokens == 17
    # FixedPerf: 0.02 ms a prefill token; the link moves 16 tokens × 1000 bytes at 1 GB/s in
    # 0.016 ms.
    assert abs(loaded[0].duration_s * 1000 - (0.02 + 0.016)) < 1e-9
    # The loaded blocks are cached on the GPU again, as if computed.
    assert any(
        isinstance(c, BlocksStored) and c.tier == "gpu" and len(c.block_hashes) == 4
        for c in loaded[0].kv_changes
    )


def test_blocks_about_to_load_are_the_last_the_host_tier_drops() -> None:
    # The admission that loads them evicts GPU blocks into a full host tier: those push out
    # the oldest host blocks, never the ones being loaded.
    pool = BlockPool(num_blocks=2, host_blocks=3)
    kv = KvCacheManager(pool, block_size=4)
    req = SimRequest.from_engine_request(make_request("p", range(9)), 4)
    head = req.hashes[:2]

    def idle(*hashes: int) -> None:
        pool.allocate(len(hashes))
        pool.cache(None, hashes)
        pool.release(hashes)

    idle(*head)
    assert pool.allocate(2)  # the prompt's blocks go to host memory
    pool.release([None, None])
    idle(111)
    assert pool.allocate(2)  # so does 111, the newest there
    pool.release([None, None])
    idle(222)
    assert kv.host_hits(req, 0) == 2
    assert pool.allocate(2)  # 222 goes to host memory: 111 is dropped, not the prompt's
    assert pool.count_host(head, 0, 2) == 2
    assert pool.count_host([111], 0, 1) == 0
