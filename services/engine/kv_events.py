"""An engine's KV changes as the events the rest of Laneway folds (live and offline alike)."""

from __future__ import annotations

from schemas.events import (
    KvBlocksRemoved,
    KvBlocksStored,
    KvCleared,
    KvEvent,
    new_id,
    utc_now,
)
from services.engine.protocol import BlocksRemoved, BlocksStored, KvChange


def kv_event(change: KvChange, worker_id: str, seq: int) -> KvEvent:
    # Built without re-validation: every field comes from the engine's own typed change. The
    # envelope's id and time are given too: pydantic inspects a default factory's signature on
    # every construction, a tenth of an offline replay's time.
    event_id, occurred_at, source = new_id(), utc_now(), f"worker/{worker_id}"
    if isinstance(change, BlocksStored):
        return KvBlocksStored.model_construct(
            event_id=event_id,
            occurred_at=occurred_at,
            source=source,
            worker_id=worker_id,
            seq=seq,
            parent_hash=change.parent_hash,
            block_hashes=change.block_hashes,
            tier=change.tier,
        )
    if isinstance(change, BlocksRemoved):
        return KvBlocksRemoved.model_construct(
            event_id=event_id,
            occurred_at=occurred_at,
            source=source,
            worker_id=worker_id,
            seq=seq,
            block_hashes=change.block_hashes,
            tier=change.tier,
        )
    return KvCleared.model_construct(
        event_id=event_id, occurred_at=occurred_at, source=source, worker_id=worker_id, seq=seq
    )
