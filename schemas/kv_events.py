"""What a worker's KV cache did: blocks stored and removed, the cache cleared, and a step's
changes in one event (the kv-indexer's and the planners' folds read them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from schemas.envelope import BlockHashes, Envelope, Frozen, KvTier


class KvBlocksStored(Envelope):
    """Blocks became cached on a worker. ``seq`` orders a worker's KV events (1, 2, 3, …)."""

    type: Literal["KvBlocksStored"] = "KvBlocksStored"
    worker_id: str
    seq: int = Field(ge=1, description="per-worker KV event sequence number")
    parent_hash: int | None = Field(default=None, description="hash of the block before the first")
    block_hashes: BlockHashes
    tier: KvTier = Field(default="gpu", description="where the blocks are cached now")


class KvBlocksRemoved(Envelope):
    """Blocks left a worker's cache (evicted or freed)."""

    type: Literal["KvBlocksRemoved"] = "KvBlocksRemoved"
    worker_id: str
    seq: int = Field(ge=1)
    block_hashes: BlockHashes
    tier: KvTier = Field(default="gpu", description="the cache tier they left")


class KvCleared(Envelope):
    """A worker dropped its whole cache (restart, reset)."""

    type: Literal["KvCleared"] = "KvCleared"
    worker_id: str
    seq: int = Field(ge=1)


class StoredRun(Frozen):
    """Blocks became cached: a chain continuing the block ``parent_hash``."""

    op: Literal["stored"] = "stored"
    parent_hash: int | None = Field(default=None, description="hash of the block before the first")
    block_hashes: BlockHashes
    tier: KvTier = Field(default="gpu", description="where the blocks are cached now")


class RemovedRun(Frozen):
    """Blocks left the cache tier (evicted or freed)."""

    op: Literal["removed"] = "removed"
    block_hashes: BlockHashes
    tier: KvTier = Field(default="gpu", description="the cache tier they left")


class CacheWiped(Frozen):
    """The whole cache was dropped (restart, reset)."""

    op: Literal["cleared"] = "cleared"


# The most changes one KvChanged holds (a worker splits a step's larger batch).
MAX_KV_CHANGES = 4096
KvOp = Annotated[StoredRun | RemovedRun | CacheWiped, Field(discriminator="op")]


class KvChanged(Envelope):
    """A worker's KV changes of one engine step, in the order they happened, under one ``seq``
    (numbered as the single-change events before it). A step stores and evicts for each request
    it runs: one message for them all costs the bus, the kv-indexer and every planner one
    message's work instead of several."""

    type: Literal["KvChanged"] = "KvChanged"
    worker_id: str
    seq: int = Field(ge=1, description="per-worker KV event sequence number")
    changes: tuple[KvOp, ...] = Field(min_length=1, max_length=MAX_KV_CHANGES)
