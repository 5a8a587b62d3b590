"""A KV event reduced to what the prefix index folds: each change's kind and block hashes."""

from __future__ import annotations

from schemas.events import (
    CacheWiped,
    KvBlocksRemoved,
    KvBlocksStored,
    KvChanged,
    KvEvent,
    StoredRun,
)

# A change: its kind (host tier: plus HOST) and its block hashes.
Change = tuple[int, tuple[int, ...]]
# An event's changes, in order (a step's batch holds several): what the index buffers per seq.
Changes = tuple[Change, ...]
STORED, REMOVED, CLEARED = 0, 1, 2
# Added to a change's kind for the host tier (the snapshot keeps the kind as a byte).
HOST = 4


def change_of(stored: bool, tier: str, block_hashes: tuple[int, ...]) -> Change:
    """The change of a stored (else removed) run of ``block_hashes`` in ``tier``."""
    kind = STORED if stored else REMOVED
    return kind + (HOST if tier == "host" else 0), block_hashes


def changes_of(event: KvEvent) -> Changes:
    if isinstance(event, KvChanged):
        return tuple(
            (CLEARED, ())
            if isinstance(op, CacheWiped)
            else change_of(isinstance(op, StoredRun), op.tier, op.block_hashes)
            for op in event.changes
        )
    if isinstance(event, KvBlocksStored | KvBlocksRemoved):
        return (change_of(isinstance(event, KvBlocksStored), event.tier, event.block_hashes),)
    return ((CLEARED, ()),)
