"""Shared helpers of the engine tests: building sim engines and requests, running any engine to
its end, and reading its results as a consumer would."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schemas.events import SamplingParams
from services.engine.protocol import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    Engine,
    EngineRequest,
    KvChange,
    RequestOutput,
    StepResult,
)
from services.engine.sim import FixedPerf, SimConfig, SimEngine


def make_engine(
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
) -> SimEngine:
    config = SimConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        perf_model="fixed",
    )
    return SimEngine(config, FixedPerf())


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 4,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    block_hashes: Sequence[int] = (),
) -> EngineRequest:
    sampling = SamplingParams(
        max_tokens=max_tokens, seed=seed, stop_token_ids=tuple(stop_token_ids)
    )
    return EngineRequest(request_id, tuple(prompt), sampling, tuple(block_hashes))


def run_to_end(engine: Engine, max_steps: int = 10_000) -> list[StepResult]:
    results: list[StepResult] = []
    while engine.has_work():
        assert len(results) < max_steps, "engine did not drain"
        results.append(engine.step())
    return results


def outputs_by_request(results: Iterable[StepResult]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for result in results:
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_by_request(results: Iterable[StepResult]) -> dict[str, list[int]]:
    return {
        rid: [t for out in outs for t in out.new_token_ids]
        for rid, outs in outputs_by_request(results).items()
    }


def stored_hashes(results: Iterable[StepResult]) -> list[int]:
    return [
        h
        for result in results
        for change in result.kv_changes
        if isinstance(change, BlocksStored)
        for h in change.block_hashes
    ]


def removed_hashes(results: Iterable[StepResult]) -> list[int]:
    return [
        h
        for result in results
        for change in result.kv_changes
        if isinstance(change, BlocksRemoved)
        for h in change.block_hashes
    ]


def fold(changes: Iterable[KvChange], cached: set[int]) -> None:
    """Apply KV changes to a consumer's view of the cache, checking each one makes sense."""
    for change in changes:
        if isinstance(change, BlocksStored):
            assert cached.isdisjoint(change.block_hashes), "stored a hash already cached"
            cached.update(change.block_hashes)
        elif isinstance(change, BlocksRemoved):
            assert cached.issuperset(change.block_hashes), "removed a hash not cached"
            cached.difference_update(change.block_hashes)
        elif isinstance(change, CacheCleared):
            cached.clear()
