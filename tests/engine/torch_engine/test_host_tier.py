"""The torch engine's host tier: blocks the GPU pool evicts are copied to CPU tensors, and a
prompt that continues into them loads them back instead of recomputing; the tokens are those of
a full recompute. On CPU the "GPU" cache is CPU memory too: this checks the copies, not speed."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.protocol import BlocksStored
from tests.engine.torch_engine._support import (
    greedy_reference,
    make_engine,
    make_request,
    outputs_by_request,
    random_prompt,
    run_to_end,
    tokens_by_request,
)

# 12 blocks of 4 tokens: a 41-token request after a 29-token one evicts five of its blocks.
SMALL_GPU = {"block_size": 4, "num_gpu_blocks": 12}


def _round_trip(model_dir: Path, host_blocks: int) -> tuple[list[int], list[int], int, int, int]:
    """Prompt A, then B (evicting most of A's blocks), then A again: A's two answers, the
    tokens A's return found cached, the prompt tokens its step computed, and the host-tier
    blocks stored along the way."""
    engine = make_engine(model_dir, **SMALL_GPU, num_host_blocks=host_blocks)
    gen = torch.Generator().manual_seed(7)
    first, other = random_prompt(gen, 21), random_prompt(gen, 33)
    answers = []
    offloaded = 0
    for request_id, prompt in (("a", first), ("b", other), ("again", first)):
        engine.add_request(make_request(request_id, prompt))
        results = run_to_end(engine)
        offloaded += sum(
            len(c.block_hashes)
            for r in results
            for c in r.kv_changes
            if isinstance(c, BlocksStored) and c.tier == "host"
        )
        answers.append(tokens_by_request(results)[request_id])
    returned = outputs_by_request(results)["again"][0]
    assert returned.cached_tokens is not None
    reference = greedy_reference(engine.model, first, 8)
    assert answers[0] == reference
    return answers[0], answers[2], returned.cached_tokens, results[0].prefill_tokens, offloaded


def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_tokens(
    tiny_model_dir: Path,
) -> None:
    before, after, cached, computed, offloaded = _round_trip(tiny_model_dir, host_blocks=32)
    assert after == before
    # Blocks 0-1 stayed on the GPU; blocks 2-4 came back from host memory; the last prompt
    # token is always computed.
    assert (cached, computed) == (20, 1)
    # Five of A's blocks when B came, five of B's when A returned.
    assert offloaded == 10


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(tiny_model_dir: Path) -> None:
    before, after, cached, computed, offloaded = _round_trip(tiny_model_dir, host_blocks=0)
    assert after == before
    assert (cached, computed, offloaded) == (8, 13, 0)


def test_a_host_tier_smaller_than_an_eviction_keeps_the_newest(tiny_model_dir: Path) -> None:
    # Two host blocks: the last two A's evictions sent there (nearest its head, released last)
    # come back.
    before, after, cached, computed, _ = _round_trip(tiny_model_dir, host_blocks=2)
    assert after == before
    assert (cached, computed) == (16, 5)
