"""Events about workers and the control plane: KV cache changes, load reports, pool moves and
planner settings (the other half of :mod:`schemas.events`, which lists every event)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from schemas.envelope import (
    BlockHashes,
    Envelope,
    Frozen,
    KvTier,
    Role,
    TokenIds,
    attempt_field,
)
from schemas.logprobs import TokenLogprob


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


class StepCost(Frozen):
    """A worker's engine step times as it measured them on its own hardware: a step that
    prefills costs ``prefill_step_ms`` plus ``prefill_ms_per_token`` a prompt token computed,
    one that decodes ``decode_step_ms`` plus ``decode_ms_per_seq`` a sequence. The planner
    predicts with it instead of its perf model, which is a guess at hardware it has not seen."""

    prefill_step_ms: float = Field(ge=0.0)
    prefill_ms_per_token: float = Field(ge=0.0)
    decode_step_ms: float = Field(ge=0.0)
    decode_ms_per_seq: float = Field(ge=0.0)


class WorkerLoadReported(Envelope):
    """A worker's load, reported periodically and on change."""

    type: Literal["WorkerLoadReported"] = "WorkerLoadReported"
    worker_id: str
    role: Role
    running: int = Field(ge=0, description="requests being generated")
    waiting: int = Field(ge=0, description="requests queued, not yet scheduled")
    waiting_prefill_tokens: int = Field(ge=0, description="prompt tokens queued for prefill")
    kv_blocks_used: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    busy_s: float = Field(
        default=0.0, ge=0.0, description="seconds spent in engine steps since the worker started"
    )
    step_cost: StepCost | None = Field(
        default=None,
        description="its steps' times as measured (engines on real hardware, once measured)",
    )


class RoleMove(Frozen):
    """One worker moved from one pool to the other."""

    worker_id: str
    from_role: Role
    to_role: Role


class RolesRebalanced(Envelope):
    """The capacity planner moved workers between the prefill and decode pools."""

    type: Literal["RolesRebalanced"] = "RolesRebalanced"
    moves: tuple[RoleMove, ...]
    reason: str


class PlannerConfigured(Envelope):
    """A planner replica started with these settings: with a ``RouteDecided`` from it (same
    ``source``), what it takes to make that decision again."""

    type: Literal["PlannerConfigured"] = "PlannerConfigured"
    policy: str = Field(description="routing policy")
    seed: int = Field(description="seed of the policy's random draws")
    kv: dict[str, Any] = Field(description="the kv policy's settings, by name")
    disagg: dict[str, Any] = Field(description="the disaggregation settings, by name")
    version: str = Field(description="Laneway version that decided")
    speedup: float = Field(
        default=1.0,
        gt=0,
        description="how many times faster than their perf model the sim workers ran "
        "(`laneway bench --time-scale`): the log's latencies are that much shorter",
    )


class RequestPlaced(Envelope):
    """The planner sent attempt ``attempt`` of the request to ``worker_id``: told to the
    request's ingress, which takes that attempt's tokens and terminal from that worker only."""

    type: Literal["RequestPlaced"] = "RequestPlaced"
    worker_id: str = Field(description="worker that generates the answer (decodes)")
    attempt: int = attempt_field()


class TokenRun(Frozen):
    """One request's tokens of one engine step, in a :class:`TokenBatch` (which holds several
    of a request's where steps came faster than the worker's token interval)."""

    request_id: str = Field(max_length=64)
    attempt: int = attempt_field()
    index: int = Field(ge=0, description="position of the first token in the completion")
    token_ids: TokenIds
    text: str = Field(description="detokenized text of `token_ids`, stop strings removed")
    logprobs: tuple[TokenLogprob, ...] = Field(
        default=(), description="one for each of `token_ids` where the request asked for them"
    )


class TokenBatch(Envelope):
    """One engine step's new tokens for every request of one ingress on one worker (steps
    faster than the worker's token interval: those since its last batch): one message per step
    per ingress instead of one per request (the ingress hands each run to its
    request as a ``TokensGenerated``)."""

    type: Literal["TokenBatch"] = "TokenBatch"
    worker_id: str
    runs: tuple[TokenRun, ...]
