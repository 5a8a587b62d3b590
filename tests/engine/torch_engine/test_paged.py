"""One step's forward pass over the paged cache against full recomputation."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.torch_engine.kv_cache import PagedKvCache, SeqChunk, paged_forward
from services.engine.torch_engine.model import LlamaForCausalLM, load_model

# float32, logits of standard deviation about 4; the measured maximum difference is 9e-6.
ATOL = 1e-4


def test_chunked_batched_paged_logits_match_full_recompute(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    block_size = 4
    cache = PagedKvCache(model.config, 32, block_size, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    # Scattered, interleaved block ids: a wrong index anywhere shows up in the logits.
    ids = torch.randperm(32, generator=gen).tolist()
    sequences = {
        "a": torch.randint(0, 300, (25,), generator=gen).tolist(),
        "b": torch.randint(0, 300, (12,), generator=gen).tolist(),
        "c": torch.randint(0, 300, (1,), generator=gen).tolist(),
    }
    tables = {"a": ids[0:7], "b": ids[7:10], "c": ids[10:11]}
    # Each step's (sequence, start, end): chunked prefills, then single-token decodes, mixed.
    steps = [
        [("a", 0, 10), ("b", 0, 5), ("c", 0, 1)],
        [("a", 10, 21), ("b", 5, 11)],
        [("b", 11, 12), ("a", 21, 24)],
        [("a", 24, 25)],
    ]
    _check_steps(model, cache, sequences, tables, steps)


def test_decodes_split_by_prefills_match_full_recompute(tiny_model_dir: Path) -> None:
    """Single-token chunks attend as one padded batch; here they are not adjacent in the step,
    their contexts span different numbers of blocks, and prefills with and without a past sit
    between them."""
    model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    block_size = 4
    cache = PagedKvCache(model.config, 40, block_size, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(40, generator=gen).tolist()
    lengths = {"a": 14, "b": 6, "c": 10, "d": 3, "e": 7}
    sequences = {s: torch.randint(0, 300, (n,), generator=gen).tolist() for s, n in lengths.items()}
    tables = {"a": ids[0:4], "b": ids[4:6], "c": ids[6:9], "d": ids[9:10], "e": ids[10:12]}
    steps = [
        [("a", 0, 13), ("b", 0, 5), ("c", 0, 4)],
        [("a", 13, 14), ("c", 4, 9), ("b", 5, 6), ("d", 0, 3), ("e", 0, 1)],
        [("c", 9, 10), ("e", 1, 7)],
    ]
    _check_steps(model, cache, sequences, tables, steps)


def _check_steps(
    model: LlamaForCausalLM,
    cache: PagedKvCache,
    sequences: dict[str, list[int]],
    tables: dict[str, list[int]],
    steps: list[list[tuple[str, int, int]]],
) -> None:
    """Run each step's (sequence, start, end) chunks; every row's logits must be the full
    recompute's."""
    with torch.inference_mode():
        for step in steps:
            chunks = [SeqChunk(sequences[s][i:j], i, tables[s]) for s, i, j in step]
            logits = model.compute_logits(paged_forward(model, cache, chunks))
            row = 0
            for s, i, j in step:
                expected = model.forward_full(torch.tensor(sequences[s][:j]))[i:j]
                got = logits[row : row + j - i]
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
                row += j - i
