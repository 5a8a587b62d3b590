"""TensorRT-LLM's KV cache events as Laneway's ``KvChange``s.

TensorRT-LLM names blocks by its own hashes, which nothing else in Laneway can compute. Its
"stored" events carry each block's tokens, though, so every stored block is re-hashed with
Laneway's chained block hash (the one ingress and the indexer use) and remembered, so that a later
"removed" event, which carries only TensorRT-LLM's hashes, can be translated too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schemas.block_hash import ROOT_HASH, hash_block
from services.engine.protocol import BlocksRemoved, BlocksStored, KvChange


class KvEventTranslator:
    """Translates the event dicts of ``LLM.get_kv_cache_events`` for one engine, in order."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        # TensorRT-LLM's hash of every full block the cache holds -> Laneway's hash of it.
        self._hashes: dict[int, int] = {}

    def translate(self, event: Mapping[str, Any]) -> list[KvChange]:
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            return self._stored(data)
        if kind == "removed":
            return self._removed(data)
        # "created" (the pool's size) and "updated" (a block's priority or tier) change nothing
        # that the index tracks.
        return []

    def _stored(self, data: Mapping[str, Any]) -> list[KvChange]:
        trt_parent = data.get("parent_hash")
        parent: int | None = None
        if trt_parent is not None:
            parent = self._hashes.get(int(trt_parent))
            if parent is None:
                # The parent was a partial block or was stored before we listened: this chain
                # cannot be hashed, and a router could never match it from the root anyway.
                return []
        chain = ROOT_HASH if parent is None else parent
        stored: list[int] = []
        for block in data.get("blocks", ()):
            tokens = [int(token["token_id"]) for token in block["tokens"]]
            if len(tokens) != self._block_size:
                # With partial reuse TensorRT-LLM also stores a sequence's unfinished last block;
                # Laneway hashes full blocks only, and nothing can follow a partial one.
                break
            chain = hash_block(chain, tokens)
            self._hashes[int(block["block_hash"])] = chain
            stored.append(chain)
        return [BlocksStored(tuple(stored), parent)] if stored else []

    def _removed(self, data: Mapping[str, Any]) -> list[KvChange]:
        removed = []
        for trt_hash in data.get("block_hashes", ()):
            # Partial blocks were never announced, so their removal is not either.
            ours = self._hashes.pop(int(trt_hash), None)
            if ours is not None:
                removed.append(ours)
        return [BlocksRemoved(tuple(removed))] if removed else []
