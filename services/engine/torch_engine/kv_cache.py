"""The paged KV cache and one step's forward pass over it.

A step is a flat batch of every scheduled sequence's new tokens: projections and MLPs run on all of
them at once, and only attention goes sequence by sequence, over the K/V its block table points at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.engine.torch_engine.model import LlamaConfig, LlamaForCausalLM, causal_attention


class PagedKvCache:
    """K and V of every layer, each [layers, num_blocks, block_size, kv_heads, head_dim]: the block
    pool's block ids index the second dimension."""

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (
            config.num_hidden_layers,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.block_size = block_size
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)

    def slots(self, block_ids: Sequence[int], num_tokens: int) -> Tensor:
        """Flat (block, offset) indices of a sequence's first ``num_tokens`` positions, on CPU."""
        bs = self.block_size
        ids = torch.tensor(block_ids[: -(-num_tokens // bs)], dtype=torch.int64)
        return (ids[:, None] * bs + torch.arange(bs)).flatten()[:num_tokens]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step: its next tokens, after ``past`` tokens whose K/V the cache
    holds, and a block table covering them all."""

    token_ids: Sequence[int]
    past: int
    block_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Span:
    start: int
    count: int
    past: int
    context: Tensor


class _PagedAttention:
    """Writes a step's new K/V into the cache, then attends each sequence over its context."""

    def __init__(self, cache: PagedKvCache, spans: list[_Span], writes: Tensor) -> None:
        self._cache = cache
        self._spans = spans
        self._writes = writes

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys = self._cache.key[layer].view(-1, *k.shape[1:])
        values = self._cache.value[layer].view(-1, *v.shape[1:])
        keys.index_copy_(0, self._writes, k)
        values.index_copy_(0, self._writes, v)
        out = torch.empty_like(q)
        for s in self._spans:
            rows = slice(s.start, s.start + s.count)
            out[rows] = causal_attention(q[rows], keys[s.context], values[s.context], s.past)
        return out


def paged_forward(
    model: LlamaForCausalLM, cache: PagedKvCache, chunks: Sequence[SeqChunk]
) -> Tensor:
    """Final hidden states [tokens, hidden] of every chunk's tokens, in order; writes their K/V
    into the cache blocks their block tables name."""
    token_ids: list[int] = []
    positions: list[Tensor] = []
    contexts: list[Tensor] = []
    writes: list[Tensor] = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        token_ids.extend(chunk.token_ids)
        positions.append(torch.arange(chunk.past, chunk.past + n))
        context = cache.slots(chunk.block_ids, chunk.past + n)
        contexts.append(context)
        writes.append(context[chunk.past :])
    device = cache.key.device
    total = len(token_ids)
    # One host-to-device copy for all of the step's indices.
    packed = torch.cat([*positions, *writes, *contexts]).to(device)
    sizes = [c.shape[0] for c in contexts]
    spans = []
    start = 0
    for chunk, context in zip(chunks, torch.split(packed[2 * total :], sizes), strict=True):
        spans.append(_Span(start, len(chunk.token_ids), chunk.past, context))
        start += len(chunk.token_ids)
    attention = _PagedAttention(cache, spans, packed[total : 2 * total])
    ids = torch.tensor(token_ids, dtype=torch.int64).to(device)
    hidden: Tensor = model(ids, packed[:total], attention)
    return hidden
