"""Chained block hashes (ARCHITECTURE.md §5), the one function ingress, indexer and engines share.

A block's hash covers its parent's hash and its own token ids, so two equal hashes imply two equal
prefixes, not just two equal blocks. Only full blocks are hashed: engines cache whole blocks only.

A request's cache salt (``RequestSpec.cache_salt``, :mod:`schemas.cache_salt`) enters the first
block's hash only, as its parent (:func:`salt_root`); the chain carries it to every later block,
so the same tokens under two salts share no block, in any cache or index keyed by these hashes.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

ROOT_HASH = 0
_MASK = (1 << 64) - 1
# array("I") is in native order: a byte widens to a uint32 by three zero bytes after it.
_LITTLE_ENDIAN = sys.byteorder == "little"


def salt_root(cache_salt: str | None) -> int:
    """The parent of a prompt's first block: ``ROOT_HASH`` unsalted (every request before salts
    existed, and every one with keys off), else a hash of the salt."""
    if cache_salt is None:
        return ROOT_HASH
    return int(xxhash.xxh3_64_intdigest(b"laneway cache salt\0" + cache_salt.encode()))


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
    # The tokens as hash_block lays them out (uint32), laid out once for all the blocks.
    words: bytes | bytearray
    if isinstance(token_ids, bytes | bytearray):
        if _LITTLE_ENDIAN:
            wide = bytearray(4 * len(token_ids))
            wide[::4] = token_ids
            words = wide
        else:
            words = array("I", memoryview(token_ids).tolist()).tobytes()
    else:
        words = array("I", token_ids).tobytes()
    width = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    hashes = []
    for start in range(0, len(words) - width + 1, width):
        parent = digest((parent & _MASK).to_bytes(8, "little") + words[start : start + width])
        hashes.append(parent)
    return tuple(hashes)
