"""TensorRT-LLM's KV cache events (the dicts of ``LLM.get_kv_cache_events``) as Laneway's
``KvChange``s: its blocks hashed again with Laneway's chained hash (``services.engine.
kv_translate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.engine.kv_translate import KvHashes
from services.engine.protocol import KvChange


class KvEventTranslator:
    """Translates one engine's events, in order."""

    def __init__(self, block_size: int) -> None:
        self._hashes = KvHashes(block_size)

    def translate(self, event: Mapping[str, Any]) -> list[KvChange]:
        data = event.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            parent = data.get("parent_hash")
            blocks = (
                (int(block["block_hash"]), [int(token["token_id"]) for token in block["tokens"]])
                for block in data.get("blocks", ())
            )
            return self._hashes.stored(None if parent is None else int(parent), blocks)
        if kind == "removed":
            return self._hashes.removed(int(h) for h in data.get("block_hashes", ()))
        # "created" (the pool's size) and "updated" (a block's priority or tier) change nothing
        # that the index tracks.
        return []
