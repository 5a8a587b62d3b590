"""A KV move between two torch engines: the source exports a prompt's blocks from its device cache
and its host tier, the target imports them, and the target's answer is the one a full recompute
gives while its prefill computes only the last prompt token."""

from __future__ import annotations

from pathlib import Path

import torch

from schemas.block_hash import chain_block_hashes
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

# 12 blocks of 4 tokens: a 33-token request after a 21-token one evicts three of its five blocks
# to the host tier.
SMALL_GPU = {"block_size": 4, "num_gpu_blocks": 12, "num_host_blocks": 32}


def test_blocks_from_both_tiers_move_and_the_tokens_are_a_full_recomputes(
    tiny_model_dir: Path,
) -> None:
    gen = torch.Generator().manual_seed(7)
    prompt, other = random_prompt(gen, 21), random_prompt(gen, 33)
    source = make_engine(tiny_model_dir, **SMALL_GPU)
    for request_id, tokens in (("a", prompt), ("b", other)):
        source.add_request(make_request(request_id, tokens))
        run_to_end(source)
    hashes = chain_block_hashes(prompt, 4)
    on_device = [h for h in hashes if h in source.cached_block_hashes()]
    held, data = source.export_prefix(hashes)
    # All five full blocks go, though only the first two are still in the device cache.
    assert on_device == list(hashes[:2])
    assert held == len(hashes) == 5

    target = make_engine(tiny_model_dir)
    assert target.import_prefix(hashes, data) == 5
    target.add_request(make_request("moved", prompt))
    results = run_to_end(target)
    stored = [c for c in results[0].kv_changes if isinstance(c, BlocksStored)]
    assert stored and stored[0].block_hashes == hashes and stored[0].tier == "gpu"
    assert tokens_by_request(results)["moved"] == greedy_reference(target.model, prompt, 8)
    assert outputs_by_request(results)["moved"][0].cached_tokens == 20
    assert results[0].prefill_tokens == 1
