"""KV hand-off between engines: a request's computed blocks out of one cache and into another,
as a prefill worker hands a prompt's KV to a decode worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.engine.kv_payload import pack, unpack
from services.engine.torch_engine.blocks import PagedBlockPool
from services.engine.torch_engine.kv_cache import PagedKvCache


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What two caches must share for blocks to move between them."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, cache: PagedKvCache) -> KvLayout:
        layers, _, block_size, kv_heads, head_dim = cache.key.shape
        return cls(block_size, layers, kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class KvExport:
    layout: KvLayout
    # Chained hashes of the exported blocks, the first a child of the root.
    block_hashes: tuple[int, ...]
    # [layers, blocks, block_size, kv_heads, head_dim], on CPU.
    key: Tensor
    value: Tensor


def export_blocks(
    cache: PagedKvCache, block_hashes: Sequence[int], block_ids: Sequence[int]
) -> KvExport:
    index = torch.tensor(block_ids, dtype=torch.int64, device=cache.key.device)
    return KvExport(
        layout=KvLayout.of(cache),
        block_hashes=tuple(block_hashes),
        key=cache.key[:, index].cpu(),
        value=cache.value[:, index].cpu(),
    )


def import_blocks(cache: PagedKvCache, pool: PagedBlockPool, export: KvExport) -> int:
    """Copy the exported blocks this cache lacks into it and cache their hashes (reported as
    ``BlocksStored`` with the pool's next changes); how many blocks were copied."""
    if export.layout != KvLayout.of(cache):
        raise ValueError(f"KV layout {export.layout} does not match {KvLayout.of(cache)}")
    first, block_ids = pool.adopt(export.block_hashes)
    if block_ids:
        index = torch.tensor(block_ids, dtype=torch.int64, device=cache.key.device)
        new = slice(first, first + len(block_ids))
        cache.key[:, index] = export.key[:, new].to(cache.key.device, cache.key.dtype)
        cache.value[:, index] = export.value[:, new].to(cache.value.device, cache.value.dtype)
    return len(block_ids)


def to_bytes(export: KvExport) -> bytes:
    return pack(export.block_hashes, {"key": export.key, "value": export.value})


def from_bytes(data: bytes) -> KvExport:
    hashes, tensors = unpack(data)
    key, value = tensors["key"], tensors["value"]
    layers, _, block_size, kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"KV value shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if len(hashes) != key.shape[1]:
        raise ValueError(f"{len(hashes)} block hashes for {key.shape[1]} KV blocks")
    return KvExport(KvLayout(block_size, layers, kv_heads, head_dim), hashes, key, value)
