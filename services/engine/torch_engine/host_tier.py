"""The torch engine's host-memory KV tier: the contents of the blocks its GPU pool evicts, kept in
CPU tensors, and copied back into a fresh block when a prompt's prefix continues there.

What is in host memory, and what leaves it, the block pool decides (an LRU of hashes beside the
GPU's, exactly as ``sim`` models it); this store only keeps each of those hashes' K and V in a
slot of two preallocated CPU tensors. With the engine on CPU the "GPU" cache is CPU memory too:
the copies and the tokens they give are real, their speed says nothing of a PCIe link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from services.engine.torch_engine.kv_cache import PagedKvCache


class HostKvStore:
    def __init__(self, cache: PagedKvCache, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("a host tier needs at least one block")
        self.num_blocks = num_blocks
        self._cache = cache
        layers, _, *block = cache.key.shape
        # Pinned when the cache is on a GPU: copies to and from it can then use DMA.
        pinned = cache.key.device.type == "cuda"
        shape = (layers, num_blocks, *block)
        self._key = torch.zeros(shape, dtype=cache.key.dtype, pin_memory=pinned)
        self._value = torch.zeros(shape, dtype=cache.key.dtype, pin_memory=pinned)
        self._slots: dict[int, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))

    def offload(self, stored: Mapping[int, int], dropped: Sequence[int]) -> None:
        """Copy the device blocks ``stored`` names (hash -> block id) out to host memory, after
        the ``dropped`` hashes gave up their slots there."""
        for block_hash in dropped:
            slot = self._slots.pop(block_hash, None)
            if slot is not None:
                self._free.append(slot)
        if not stored:
            return
        slots = [self._free.pop() for _ in stored]
        self._slots.update(zip(stored, slots, strict=True))
        ids = torch.tensor(list(stored.values()), device=self._cache.key.device)
        at = torch.tensor(slots)
        self._key[:, at] = self._cache.key[:, ids].to("cpu")
        self._value[:, at] = self._cache.value[:, ids].to("cpu")

    def read(self, hashes: Sequence[int]) -> tuple[Tensor, Tensor]:
        """A copy of the K and V of ``hashes``: a request's admission may evict so much that
        the host tier drops the very blocks it is about to load, so it takes them first."""
        at = torch.tensor([self._slots[h] for h in hashes])
        return self._key[:, at], self._value[:, at]

    def load(self, blocks: tuple[Tensor, Tensor], block_ids: Sequence[int]) -> None:
        """Copy blocks ``read`` gave into the device blocks ``block_ids``; the host copies stay
        (the tiers are inclusive)."""
        device = self._cache.key.device
        ids = torch.tensor(list(block_ids), device=device)
        key, value = blocks
        self._cache.key[:, ids] = key.to(device)
        self._cache.value[:, ids] = value.to(device)
