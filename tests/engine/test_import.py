"""KV blocks handed over by another engine join the prefix cache as if computed here."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.common.perf_model import FixedPerf
from services.engine.protocol import EngineRequest, KvChange
from services.engine.sim import SimConfig, SimEngine

from ._sim_support import fold


def engine(blocks: int) -> SimEngine:
    return SimEngine(SimConfig(block_size=4, num_gpu_blocks=blocks), FixedPerf(0.0, 0.0))


def folded(changes: Iterable[KvChange]) -> set[int]:
    cached: set[int] = set()
    fold(changes, cached)
    return cached


def test_imported_blocks_are_prefix_hits() -> None:
    prompt = list(range(1, 18))  # 4 full blocks and one token
    hashes = chain_block_hashes(prompt, 4)
    e = engine(16)
    assert e.import_blocks(hashes) == 4
    e.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=2)))
    first = e.step()
    assert first.prefill_tokens == 1
    assert first.outputs[0].cached_tokens == 16
    assert folded(first.kv_changes) | set(hashes) == e.cached_block_hashes()


def test_import_stops_when_the_pool_is_full_and_events_fold_exactly() -> None:
    e = engine(3)
    e.add_request(EngineRequest("busy", list(range(1, 9)), SamplingParams(max_tokens=1)))
    changes = list(e.step().kv_changes)  # 2 blocks held by a running request... then freed
    hashes = chain_block_hashes(list(range(100, 120)), 4)  # 5 blocks offered, room for fewer
    done = e.import_blocks(hashes)
    changes += e.step().kv_changes
    assert 0 < done < 5
    assert set(hashes[:done]) <= e.cached_block_hashes()
    assert folded(changes) == e.cached_block_hashes()
