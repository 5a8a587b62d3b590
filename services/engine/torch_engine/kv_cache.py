"""The paged KV cache and one step's forward pass over it.

A step is a flat batch of every scheduled sequence's new tokens: projections and MLPs run on all of
them at once. Attention runs once per layer for all single-token sequences (decodes), padded to the
longest context, and once per layer for each longer chunk (prefills). Every index and mask those
calls need is built once per step, before the first layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
        # K and V of one token in every layer.
        self.bytes_per_token = 2 * self.key[:, 0, 0].numel() * self.key.element_size()


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a step: its next tokens, after ``past`` tokens whose K/V the cache
    holds, and a block table covering them all."""

    token_ids: Sequence[int]
    past: int
    block_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class _Prefill:
    """A chunk of several tokens. Without a past its own K/V are its whole context, so it needs
    neither the cache nor a mask."""

    rows: slice
    past: int
    # Its context's blocks, and which of their keys each query sees, when it has a past.
    blocks: Tensor | None
    mask: Tensor | None


@dataclass(frozen=True, slots=True)
class _Decodes:
    """Every single-token chunk, attended together over block tables padded to the longest."""

    rows: slice | Tensor
    # [sequences, blocks], padded with block 0.
    blocks: Tensor
    # [sequences, 1, 1, blocks * block_size]: which keys are each sequence's context.
    mask: Tensor


class _PagedAttention:
    """Writes a step's new K/V into the cache, then attends each sequence over its context."""

    def __init__(
        self,
        cache: PagedKvCache,
        writes: Tensor,
        prefills: list[_Prefill],
        decodes: _Decodes | None,
    ) -> None:
        self._cache = cache
        self._writes = writes
        self._prefills = prefills
        self._decodes = decodes
        # A group that is the whole step returns its output as the step's, with no scatter.
        self._alone = len(prefills) + (decodes is not None) == 1

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        _, kv_heads, dim = k.shape
        keys = self._cache.key[layer]
        values = self._cache.value[layer]
        keys.view(-1, kv_heads, dim).index_copy_(0, self._writes, k)
        values.view(-1, kv_heads, dim).index_copy_(0, self._writes, v)
        decodes = self._decodes
        if self._alone:
            if decodes is not None:
                return _attend_decodes(decodes, q, keys, values)
            return _attend_prefill(self._prefills[0], q, k, v, keys, values)
        out = torch.empty_like(q)
        for p in self._prefills:
            out[p.rows] = _attend_prefill(p, q, k, v, keys, values)
        if decodes is not None:
            out[decodes.rows] = _attend_decodes(decodes, q, keys, values)
        return out


def _attend_prefill(
    p: _Prefill, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor
) -> Tensor:
    if p.blocks is None:
        return causal_attention(q[p.rows], k[p.rows], v[p.rows], 0)
    _, _, kv_heads, dim = keys.shape
    context = p.past + p.rows.stop - p.rows.start
    k_ctx = keys.index_select(0, p.blocks).view(-1, kv_heads, dim)[:context]
    v_ctx = values.index_select(0, p.blocks).view(-1, kv_heads, dim)[:context]
    return causal_attention(q[p.rows], k_ctx, v_ctx, p.past, p.mask)


def _attend_decodes(d: _Decodes, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    seqs = d.blocks.shape[0]
    _, _, kv_heads, dim = keys.shape
    heads = q.shape[1]
    flat = d.blocks.flatten()
    k_ctx = keys.index_select(0, flat).view(seqs, -1, kv_heads, dim).transpose(1, 2)
    v_ctx = values.index_select(0, flat).view(seqs, -1, kv_heads, dim).transpose(1, 2)
    # One query per sequence, heads as the SDPA heads: the CPU kernel measured faster this way
    # than with each KV head's query group as rows.
    out = F.scaled_dot_product_attention(
        q[d.rows].view(seqs, heads, 1, dim), k_ctx, v_ctx, attn_mask=d.mask, enable_gqa=True
    )
    return out.view(seqs, heads, dim)


def paged_forward(
    model: LlamaForCausalLM, cache: PagedKvCache, chunks: Sequence[SeqChunk]
) -> Tensor:
    """Final hidden states [tokens, hidden] of every chunk's tokens, in order; writes their K/V
    into the cache blocks their block tables name."""
    bs = cache.block_size
    token_ids: list[int] = []
    positions: list[int] = []
    writes: list[int] = []
    # Each prefill's rows and past, and where its blocks start in prefill_blocks, how many.
    prefill_spans: list[tuple[slice, int, int, int]] = []
    prefill_blocks: list[int] = []
    decode_rows: list[int] = []
    decode_lens: list[int] = []
    decode_tables: list[Sequence[int]] = []
    for chunk in chunks:
        n = len(chunk.token_ids)
        past = chunk.past
        ids = chunk.block_ids
        row = len(token_ids)
        span = range(past, past + n)
        token_ids.extend(chunk.token_ids)
        positions.extend(span)
        writes.extend([ids[p // bs] * bs + p % bs for p in span])
        used = ids[: -(-(past + n) // bs)]
        if n == 1:
            decode_rows.append(row)
            decode_lens.append(past + 1)
            decode_tables.append(used)
        elif past:
            prefill_spans.append((slice(row, row + n), past, len(prefill_blocks), len(used)))
            prefill_blocks.extend(used)
        else:
            prefill_spans.append((slice(row, row + n), 0, 0, 0))
    width = max(map(len, decode_tables), default=0)
    decode_blocks: list[int] = []
    for table in decode_tables:
        decode_blocks.extend(table)
        decode_blocks.extend([0] * (width - len(table)))
    device = cache.key.device
    # One host-to-device copy for all of the step's indices.
    parts = (token_ids, positions, writes, prefill_blocks, decode_rows, decode_lens, decode_blocks)
    packed = torch.tensor([i for part in parts for i in part], dtype=torch.int64).to(device)
    ids_t, positions_t, writes_t, blocks_t, rows_t, lens_t, tables_t = torch.split(
        packed, [len(part) for part in parts]
    )
    prefills = []
    for rows, past, first, count in prefill_spans:
        if not past:
            prefills.append(_Prefill(rows, 0, None, None))
            continue
        end = past + rows.stop - rows.start
        mask = torch.arange(end, device=device) <= torch.arange(past, end, device=device)[:, None]
        prefills.append(_Prefill(rows, past, blocks_t[first : first + count], mask))
    decodes = None
    if decode_rows:
        seqs = len(decode_rows)
        lo = decode_rows[0]
        key_pos = torch.arange(width * bs, device=device)
        decodes = _Decodes(
            # Rows only ever increase, so spanning exactly ``seqs`` rows means contiguous.
            slice(lo, lo + seqs) if decode_rows[-1] - lo == seqs - 1 else rows_t,
            tables_t.view(seqs, width),
            (key_pos < lens_t[:, None]).view(seqs, 1, 1, -1),
        )
    attention = _PagedAttention(cache, writes_t, prefills, decodes)
    hidden: Tensor = model(ids_t, positions_t, attention)
    return hidden
