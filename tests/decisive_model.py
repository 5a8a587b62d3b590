"""A tiny model whose greedy answers no rounding can change: for the vLLM tests, which hold an
answer computed one way (batched, handed over, or continued on another worker, recomputed there
in one prefill) to the tokens it has computed another.

`laneway make-tiny-model`'s random weights give near-even logits: two candidates often lie
within float32 rounding of each other, and a prefill and a decode step of the same position
round differently (measured: one stream in twelve took another token after a migration). Here
the embeddings are large (standard deviation 1, against the layers' 0.02) and the output head
holds them permuted, so the next token is a fixed permutation of the last one, by a margin of
about 256 logits against a standard deviation of 16 for the others. The layers still run and
attend; they only cannot tip a choice. Special tokens are never chosen (their rows are zero): no
answer ends early."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.engine.torch_engine.tiny import SPECIAL_TOKENS, VOCAB_SIZE, make_tiny_model


def make_decisive_model(directory: Path, seed: int = 0) -> None:
    make_tiny_model(directory, seed=seed)
    path = directory / "model.safetensors"
    weights = load_file(str(path))
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(weights["model.embed_tokens.weight"].shape, generator=generator)
    ordinary = torch.arange(len(SPECIAL_TOKENS), VOCAB_SIZE)
    # Token t is followed by next_of[t]: a shuffle of the ordinary tokens.
    next_of = ordinary[torch.randperm(len(ordinary), generator=generator)]
    head = torch.zeros_like(embed)
    head[next_of] = embed[ordinary]
    # The special tokens' own successors (a prompt may hold them): ordinary ones too.
    head[ordinary[: len(SPECIAL_TOKENS)]] += embed[: len(SPECIAL_TOKENS)]
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    save_file(weights, str(path), metadata={"format": "pt"})
