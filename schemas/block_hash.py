"""Chained block hashes (ARCHITECTURE.md §5), the one function ingress, indexer and engines share.

A block's hash covers its parent's hash and its own token ids, so two equal hashes imply two equal
prefixes, not just two equal blocks. Only full blocks are hashed: engines cache whole blocks only.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0
_MASK = (1 << 64) - 1


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """xxh3-64 of the parent hash (8 bytes, little endian) followed by the tokens as uint32."""
    # array() would read a bytes object as raw machine words, not as a sequence of ids.
    ids = memoryview(token_ids).tolist() if isinstance(token_ids, bytes | bytearray) else token_ids
    payload = (parent & _MASK).to_bytes(8, "little") + array("I", ids).tobytes()
    return int(xxhash.xxh3_64_intdigest(payload))


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
) -> tuple[int, ...]:
    """Hashes of every full block of ``token_ids``; a trailing partial block gets none."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    # The payload hash_block builds per block, built once for all of them.
    ids = memoryview(token_ids).tolist() if isinstance(token_ids, bytes | bytearray) else token_ids
    words = array("I", ids).tobytes()
    width = 4 * block_size
    hashes = []
    for start in range(0, len(words) - width + 1, width):
        payload = (parent & _MASK).to_bytes(8, "little") + words[start : start + width]
        parent = int(xxhash.xxh3_64_intdigest(payload))
        hashes.append(parent)
    return tuple(hashes)
