"""The bytes of a KV hand-off, one codec for every engine that exports real KV (torch, vLLM):
the exported blocks' chained hashes and their KV tensors, in whatever layout the engine keeps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from safetensors.torch import load, save
from torch import Tensor

_U64 = 1 << 64
_HASHES = "hashes"


def pack(block_hashes: Sequence[int], tensors: Mapping[str, Tensor]) -> bytes:
    """safetensors, not pickle: the bytes come over the network."""
    if _HASHES in tensors:
        raise ValueError(f"{_HASHES!r} names the block hashes")
    # Hashes are unsigned 64-bit; torch has no such tensor dtype, so they travel as int64 bits.
    signed = [h - _U64 if h >= _U64 >> 1 else h for h in block_hashes]
    return save(
        {
            **{name: tensor.contiguous() for name, tensor in tensors.items()},
            _HASHES: torch.tensor(signed, dtype=torch.int64),
        }
    )


def unpack(data: bytes) -> tuple[tuple[int, ...], dict[str, Tensor]]:
    """The block hashes and the named tensors :func:`pack` wrote; the caller checks their shapes."""
    tensors = load(data)
    hashes = tensors.pop(_HASHES, None)
    if hashes is None:
        raise ValueError("the KV payload has no block hashes")
    return tuple(h % _U64 for h in hashes.tolist()), tensors
