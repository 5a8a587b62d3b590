"""An engine's own KV cache events as Laneway's ``KvChange``s, for engines that name blocks by
hashes of their own (TensorRT-LLM, vLLM), which nothing else in Laneway can compute.

Their "stored" events carry each block's tokens, though, so every stored block is hashed again
with Laneway's chained block hash (the one the ingress and the indexer use) and remembered, so
that a later "removed" event, which carries only the engine's hashes, can be translated too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schemas.block_hash import ROOT_HASH, hash_block
from services.engine.protocol import BlocksRemoved, BlocksStored, CacheCleared, KvChange

# An engine's name for a block: TensorRT-LLM's is an int, vLLM's the bytes of its own hash.
EngineHash = int | bytes


class KvHashes:
    """One engine's block hashes and Laneway's for the same blocks, folded from its events in
    order."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        # The engine's hash of every full block the cache holds -> Laneway's hash of it.
        self._hashes: dict[EngineHash, int] = {}
        # And back, for an engine asked for blocks by Laneway's hashes (a KV export).
        self._engine: dict[int, EngineHash] = {}

    def stored(
        self,
        engine_parent: EngineHash | None,
        blocks: Iterable[tuple[EngineHash, Sequence[int]]],
        root: int = ROOT_HASH,
    ) -> list[KvChange]:
        """Blocks stored after ``engine_parent`` (None: the first blocks of a prompt, whose
        chain starts at ``root``, the request's cache salt), each its engine hash and tokens."""
        parent: int | None = None
        if engine_parent is not None:
            parent = self._hashes.get(engine_parent)
            if parent is None:
                # The parent was a partial block or was stored before we listened: this chain
                # cannot be hashed, and a router could never match it from the root anyway.
                return []
        chain = root if parent is None else parent
        stored: list[int] = []
        for engine_hash, tokens in blocks:
            if len(tokens) != self._block_size:
                # An unfinished last block (an engine with partial reuse stores one): Laneway
                # hashes full blocks only, and nothing can follow a partial one.
                break
            chain = hash_block(chain, tokens)
            self._hashes[engine_hash] = chain
            self._engine[chain] = engine_hash
            stored.append(chain)
        return [BlocksStored(tuple(stored), parent)] if stored else []

    def removed(self, engine_hashes: Iterable[EngineHash]) -> list[KvChange]:
        # Partial blocks were never announced, so their removal is not either.
        removed = [ours for h in engine_hashes if (ours := self._hashes.pop(h, None)) is not None]
        for ours in removed:
            self._engine.pop(ours, None)
        return [BlocksRemoved(tuple(removed))] if removed else []

    def cleared(self) -> list[KvChange]:
        self._hashes.clear()
        self._engine.clear()
        return [CacheCleared()]

    def engine_hash(self, ours: int) -> EngineHash | None:
        """The engine's hash of the block Laneway calls ``ours``, while the cache holds it."""
        return self._engine.get(ours)
