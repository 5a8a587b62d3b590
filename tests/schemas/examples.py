"""One event of every kind the request path and the workers publish, for tests of their
encoding."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from schemas.block_hash import chain_block_hashes
from schemas.events import (
    CancellationRequested,
    CapacityReviewed,
    KvBlocksRemoved,
    KvBlocksStored,
    KvChanged,
    KvCleared,
    KvTransferred,
    PlannerConfigured,
    PrefillCompleted,
    RequestAccepted,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    RequestSpec,
    RoleMove,
    RolesRebalanced,
    RouteCandidate,
    RouteDecided,
    SamplingParams,
    TokenBatch,
    TokenRun,
    TokensGenerated,
    Usage,
    WorkerLoadReported,
)
from schemas.kv_events import CacheWiped, RemovedRun, StoredRun

SPEC = RequestSpec(
    model="m",
    prompt_token_ids=(1, 2, 3),
    block_size=2,
    block_hashes=chain_block_hashes((1, 2, 3), 2),
    sampling=SamplingParams(max_tokens=4, stop=("x",), seed=3),
    reply_to="ing",
    deadline=datetime(2030, 1, 1, tzinfo=UTC),
)
SRC = {"source": "test/1", "request_id": "r1"}

EXAMPLES: list[BaseModel] = [
    RequestAccepted(**SRC, spec=SPEC),
    RouteDecided(
        **SRC,
        worker_id="w",
        policy="p",
        reason="why",
        candidates=(
            RouteCandidate(
                worker_id="w", cached_blocks=1, running=0, waiting=0, kv_usage=0.5, cost=1.0
            ),
        ),
        spec=SPEC,
    ),
    PrefillCompleted(**SRC, worker_id="p", decode_worker_id="d", prefilled_tokens=3),
    KvTransferred(**SRC, from_worker_id="p", to_worker_id="d", block_hashes=(7,), transfer_ms=1),
    TokensGenerated(**SRC, worker_id="w", index=0, token_ids=(5, 6), text="ab"),
    RequestFinished(
        **SRC,
        worker_id="w",
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=4),
        ttft_ms=1,
        e2e_ms=2,
    ),
    RequestFailed(**SRC, code="worker_lost", message="gone"),
    CancellationRequested(**SRC, reason="timeout"),
    RequestCancelled(**SRC, reason="client_disconnected"),
    KvBlocksStored(source="w/1", worker_id="w", seq=1, parent_hash=None, block_hashes=(2**64 - 1,)),
    KvBlocksRemoved(source="w/1", worker_id="w", seq=2, block_hashes=(1,)),
    KvCleared(source="w/1", worker_id="w", seq=3),
    WorkerLoadReported(
        source="w/1",
        worker_id="w",
        role="both",
        running=1,
        waiting=0,
        waiting_prefill_tokens=0,
        kv_blocks_used=1,
        kv_blocks_total=2,
    ),
    RolesRebalanced(
        source="p/1",
        moves=(RoleMove(worker_id="w", from_role="decode", to_role="prefill"),),
        reason="ttft",
    ),
    CapacityReviewed(
        source="p/1",
        model="m",
        ttft_p95_ms=900.0,
        itl_p95_ms=None,
        ttft_target_ms=500.0,
        itl_target_ms=20.0,
        prefill_workers=0,
        decode_workers=8,
        reason="TTFT p95 at 1.80× target, aggregated: every worker prefills already",
        out_of_reach=("ttft",),
    ),
    KvChanged(
        source="worker/w",
        worker_id="w",
        seq=2,
        changes=(
            StoredRun(parent_hash=7, block_hashes=(8, 9), tier="host"),
            RemovedRun(block_hashes=(3,)),
            CacheWiped(),
        ),
    ),
    PlannerConfigured(
        source="planner/p1",
        policy="kv",
        seed=3,
        kv={"decode_weight": 1.0},
        disagg={"mode": "auto"},
        version="0.1.0",
        speedup=4.0,
    ),
    RequestPlaced(source="planner/p1", request_id="r1", worker_id="w", attempt=1),
    # Kept last: tests take it as EXAMPLES[-1].
    TokenBatch(
        source="worker/w",
        worker_id="w",
        runs=(TokenRun(request_id="r1", index=0, token_ids=(5,), text="a"),),
    ),
]
