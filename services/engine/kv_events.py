"""An engine's KV changes as the events the rest of Laneway folds (live and offline alike)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.events import (
    KvBlocksRemoved,
    KvBlocksStored,
    KvCleared,
    KvEvent,
    new_id,
    utc_now,
)
from services.engine.protocol import BlocksRemoved, BlocksStored, KvChange


def coalesced(changes: Sequence[KvChange]) -> list[KvChange]:
    """One step's changes with neighbours that say one thing as one: removals from one tier in a
    row (a step evicts for each request it admits, one after the other), and a stored run that
    continues the run just before it (its parent is that run's last block). Folded in order they
    leave the same index in fewer events, each a stored message every reader of the KV stream
    takes in; nothing is moved past a change of another kind."""
    out: list[KvChange] = []
    for change in changes:
        joined = _joined(out[-1], change) if out else None
        if joined is None:
            out.append(change)
        else:
            out[-1] = joined
    return out


def _joined(last: KvChange, change: KvChange) -> KvChange | None:
    """``last`` then ``change`` as one change, if they can be."""
    if (
        isinstance(last, BlocksRemoved)
        and isinstance(change, BlocksRemoved)
        and last.tier == change.tier
    ):
        return BlocksRemoved(last.block_hashes + change.block_hashes, last.tier)
    if (
        isinstance(last, BlocksStored)
        and isinstance(change, BlocksStored)
        and change.tier == last.tier
        and change.parent_hash == last.block_hashes[-1]
    ):
        return BlocksStored(last.block_hashes + change.block_hashes, last.parent_hash, last.tier)
    return None


def kv_event(change: KvChange, worker_id: str, seq: int) -> KvEvent:
    # Validated construction: pydantic's model_construct fills defaults in Python and costs
    # about twice as much for these models.
    event_id, occurred_at, source = new_id(), utc_now(), f"worker/{worker_id}"
    if isinstance(change, BlocksStored):
        return KvBlocksStored(
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
        return KvBlocksRemoved(
            event_id=event_id,
            occurred_at=occurred_at,
            source=source,
            worker_id=worker_id,
            seq=seq,
            block_hashes=change.block_hashes,
            tier=change.tier,
        )
    return KvCleared(
        event_id=event_id, occurred_at=occurred_at, source=source, worker_id=worker_id, seq=seq
    )
