"""Every event of ARCHITECTURE.md §2: one envelope, frozen payload models, documented units.

Events are immutable facts. A field's meaning never changes once published: a new meaning gets a
new ``schema_version`` and an upcaster in :mod:`schemas.codec`.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.latency import LatencyHistogram

TokenIds = tuple[int, ...]
BlockHashes = tuple[Annotated[int, Field(ge=0, lt=1 << 64)], ...]
Role = Literal["prefill", "decode", "both"]
FinishReason = Literal["stop", "length"]
# Where a worker caches KV blocks: GPU memory, or host memory that a hit loads back over PCIe.
KvTier = Literal["gpu", "host"]


def _attempt() -> Any:
    return Field(
        default=0, ge=0, description="the request's attempt (`RequestSpec.attempt`) this is of"
    )


def new_id() -> str:
    """A 32-hex-digit identifier, safe to use as a NATS subject token."""
    return uuid.uuid4().hex


def utc_now() -> datetime:
    return datetime.now(UTC)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TraceContext(Frozen):
    """W3C trace context of the span that caused this event."""

    traceparent: str = Field(description="W3C `traceparent` header value")
    tracestate: str | None = Field(default=None, description="W3C `tracestate` header value")


class Envelope(Frozen):
    """Fields every event carries. Subclasses fix ``type`` and add their payload."""

    event_id: str = Field(default_factory=new_id, description="unique id, used for de-duplication")
    schema_version: int = Field(default=1, description="version of this event type's payload")
    occurred_at: datetime = Field(default_factory=utc_now, description="UTC time of the fact")
    source: str = Field(description="emitting service and instance, `service/instance`")
    request_id: str | None = Field(default=None, description="request this event concerns")
    session_id: str | None = Field(default=None, description="conversation the request belongs to")
    trace: TraceContext | None = Field(default=None, description="trace context of the cause")


class SamplingParams(Frozen):
    """Generation settings as the client asked for them (OpenAI semantics)."""

    max_tokens: int = Field(ge=1, description="maximum number of generated tokens")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus probability mass")
    seed: int | None = Field(default=None, description="sampling seed; fixed seed, fixed output")
    stop: tuple[str, ...] = Field(default=(), description="generation ends before any of these")
    stop_token_ids: TokenIds = Field(default=(), description="generation ends after any of these")
    ignore_eos: bool = Field(default=False, description="keep generating past end-of-sequence")
    offset: int = Field(
        default=0,
        ge=0,
        description="answer tokens already generated, the last of the prompt (a migrated "
        "request's continuation): sampling continues at this position of the answer",
    )


class RequestSpec(Frozen):
    """What a worker needs to serve a request; carried from ingress to the worker unchanged."""

    model: str = Field(description="served model name the client asked for")
    prompt_token_ids: TokenIds = Field(description="tokenized prompt, chat template applied")
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="prompt length where `prompt_token_ids` were withheld (a redacted recording)",
    )
    block_size: int = Field(gt=0, description="tokens per block used for `block_hashes`")
    block_hashes: BlockHashes = Field(description="chained hashes of the prompt's full blocks")
    sampling: SamplingParams
    reply_to: str = Field(description="ingress instance that streams the answer to the client")
    deadline: datetime = Field(description="UTC time after which the client is no longer waiting")
    tenant: str | None = Field(
        default=None,
        max_length=64,
        description="tenant of the API key the request came with; None: the API takes no keys",
    )
    attempt: int = Field(
        default=0, ge=0, description="times the request moved to another worker before this"
    )

    @property
    def prompt_length(self) -> int:
        """Tokens in the prompt, whether or not its ids are here."""
        return len(self.prompt_token_ids) if self.prompt_tokens is None else self.prompt_tokens


class RequestAccepted(Envelope):
    """Ingress validated a client request and handed it to the planner."""

    type: Literal["RequestAccepted"] = "RequestAccepted"
    spec: RequestSpec


class RouteCandidate(Frozen):
    """One worker the planner weighed: everything the planner knew of it (so that the decision can
    be made again from the event alone), and the cost it came to."""

    worker_id: str
    cached_blocks: int = Field(ge=0, description="leading prompt blocks already in its cache")
    running: int = Field(ge=0, description="requests it is running, as last reported")
    waiting: int = Field(ge=0, description="requests queued on it, as last reported")
    kv_usage: float = Field(ge=0.0, le=1.0, description="fraction of its KV blocks in use")
    in_flight: int = Field(
        default=0, ge=0, description="requests this planner routed there that have not ended"
    )
    waiting_prefill_tokens: int = Field(
        default=0, ge=0, description="prompt tokens queued there, routes since the report included"
    )
    block_size: int = Field(default=16, gt=0, description="tokens per KV block")
    kv_capacity_tokens: int = Field(default=0, ge=0, description="its KV cache size in tokens")
    owns_session: bool = Field(default=False, description="it owns the request's session")
    kv_handoff: bool = Field(default=False, description="it can send or take a prompt's KV")
    cost: float = Field(description="policy cost; the lowest wins")
    predicted_queue_ms: float | None = Field(
        default=None, description="predicted wait behind work queued there, milliseconds"
    )
    predicted_prefill_ms: float | None = Field(
        default=None, description="predicted prefill of the uncached prompt there, milliseconds"
    )
    host_blocks: int = Field(
        default=0, ge=0, description="prompt blocks after cached_blocks in its host-memory tier"
    )
    node: str = Field(default="", description="node it runs on ('': unknown)")
    rack: str = Field(default="", description="rack of its node ('': unknown)")


class TtftAlternative(Frozen):
    """One way the planner could have served a request, and its predicted time to first token."""

    action: Literal["owner", "move", "recompute"] = Field(
        description="run where the KV is, pull the KV to worker_id, or recompute it there"
    )
    worker_id: str = Field(description="worker that would prefill and decode")
    predicted_ttft_ms: float = Field(description="predicted TTFT, KV transfer included, ms")


class KvMove(Frozen):
    """KV the chosen worker pulls from another worker's cache before prefilling the rest."""

    source_worker_id: str = Field(description="worker whose GPU or host tier holds the KV")
    blocks: int = Field(ge=1, description="leading prompt blocks moved")
    transfer_ms: float = Field(ge=0.0, description="predicted transfer time over the link, ms")
    alternatives: tuple[TtftAlternative, ...] = Field(
        default=(), description="the options weighed, the chosen one included"
    )


class PrefillPlacement(Frozen):
    """Where the prompt's uncached part is prefilled, and the predictions that decided it."""

    prefill_worker_id: str | None = Field(
        description="prefill worker that computes the prompt; None: the decode worker itself"
    )
    local_ms: float = Field(description="predicted TTFT prefilling on the decode worker, ms")
    remote_ms: float | None = Field(
        default=None, description="predicted TTFT prefilling remotely, KV transfer included, ms"
    )
    reason: str
    candidates: tuple[RouteCandidate, ...] = Field(
        default=(), description="prefill workers weighed; cost: their predicted cost, ms"
    )


class RouteDecided(Envelope):
    """The planner chose a worker for a request. With remote prefill, the same decision also goes
    to the prefill worker, which computes the prompt and hands its KV to ``worker_id``."""

    type: Literal["RouteDecided"] = "RouteDecided"
    # 2: a candidate's `score` is called `cost`, as the policies call it. 3: a candidate carries
    # all the planner knew of the worker, and the decision its policy's turn.
    schema_version: int = 3
    worker_id: str = Field(description="worker that generates the answer (decodes)")
    policy: str = Field(description="routing policy that decided")
    reason: str = Field(description="why this worker, in words")
    candidates: tuple[RouteCandidate, ...] = Field(description="every worker weighed")
    spec: RequestSpec
    prefill: PrefillPlacement | None = Field(
        default=None, description="the disaggregation decision; None: no prefill pool to weigh"
    )
    policy_turn: int = Field(
        default=0, ge=0, description="the policy's rotation counter before deciding (tie-breaks)"
    )
    kv_move: KvMove | None = Field(
        default=None, description="KV pulled from another worker first; None: no move"
    )
    expected_output_tokens: int | None = Field(
        default=None, ge=0, description="output length the cost model assumed; None: max_tokens"
    )


class KvPayload(Frozen):
    """How a hand-off's KV tensors travel: chunks on the decode worker's hand-off subject."""

    chunks: int = Field(ge=1, description="number of chunks")
    size: int = Field(ge=0, description="total bytes")
    sha256: str = Field(description="hex SHA-256 of the whole payload")


class PrefillCompleted(Envelope):
    """A prefill worker finished a request's prompt and hands its KV to the decode worker.
    ``error`` set: it could not, and the decode worker prefills locally instead."""

    type: Literal["PrefillCompleted"] = "PrefillCompleted"
    worker_id: str = Field(description="prefill worker")
    decode_worker_id: str = Field(description="worker that will decode")
    prefilled_tokens: int = Field(ge=0, description="prompt tokens computed (not from cache)")
    cached_tokens: int = Field(default=0, ge=0, description="prompt tokens it found cached")
    first_token_id: int | None = Field(default=None, description="the first generated token")
    finish_reason: FinishReason | None = Field(
        default=None, description="set when the first token already ends the answer"
    )
    block_hashes: BlockHashes = Field(
        default=(), description="the prompt blocks handed over, at the engines' block size"
    )
    payload: KvPayload | None = Field(
        default=None, description="the tensors' chunks; None: the engine models KV (sim)"
    )
    error: str | None = Field(default=None, description="why the prefill did not complete")


class KvTransferred(Envelope):
    """A request's KV blocks arrived at the decode worker."""

    type: Literal["KvTransferred"] = "KvTransferred"
    from_worker_id: str
    to_worker_id: str
    block_hashes: BlockHashes
    transfer_ms: float = Field(ge=0.0, description="time the hand-off took, milliseconds")


class TokensGenerated(Envelope):
    """Tokens one engine step produced for one request (never one message per token)."""

    type: Literal["TokensGenerated"] = "TokensGenerated"
    worker_id: str
    index: int = Field(ge=0, description="position of the first token in the completion")
    token_ids: TokenIds
    text: str = Field(description="detokenized text of `token_ids`, stop strings removed")
    attempt: int = _attempt()


class Usage(Frozen):
    """Token counts, as OpenAI reports them."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0, description="prompt tokens served from KV cache")


class RequestFinished(Envelope):
    """Terminal: the request completed normally."""

    type: Literal["RequestFinished"] = "RequestFinished"
    worker_id: str
    attempt: int = _attempt()
    finish_reason: FinishReason
    usage: Usage
    ttft_ms: float = Field(ge=0.0, description="route received to first token, milliseconds")
    e2e_ms: float = Field(ge=0.0, description="route received to last token, milliseconds")
    token_gaps: LatencyHistogram = Field(
        default_factory=LatencyHistogram,
        description="gaps between consecutive generated tokens, milliseconds",
    )
    stalled_gaps: int = Field(
        default=0, ge=0, description="token gaps whose step also computed prompt tokens"
    )
    prefill_worker_id: str | None = Field(
        default=None, description="the worker whose KV hand-off it decoded from, if any"
    )


FailureCode = Literal[
    "worker_lost", "engine_error", "no_worker", "invalid_request", "timeout", "incomplete_stream"
]


class RequestFailed(Envelope):
    """Terminal: the request cannot complete."""

    type: Literal["RequestFailed"] = "RequestFailed"
    code: FailureCode
    attempt: int = _attempt()
    message: str
    worker_id: str | None = None
    completion_tokens: int = Field(
        default=0, ge=0, description="tokens published for the request before it failed"
    )


class CancellationRequested(Envelope):
    """Ingress no longer wants the answer; whoever holds the request ends it (RequestCancelled)."""

    type: Literal["CancellationRequested"] = "CancellationRequested"
    reason: Literal["client_disconnected", "timeout"]


class RequestCancelled(Envelope):
    """Terminal: the request was stopped on the client's behalf."""

    type: Literal["RequestCancelled"] = "RequestCancelled"
    worker_id: str | None = None
    attempt: int = _attempt()
    reason: str
    completion_tokens: int = Field(default=0, ge=0, description="tokens generated before the stop")


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


class RoleMove(Frozen):
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


Event = Annotated[
    RequestAccepted
    | RouteDecided
    | PrefillCompleted
    | KvTransferred
    | TokensGenerated
    | RequestFinished
    | RequestFailed
    | CancellationRequested
    | RequestCancelled
    | KvBlocksStored
    | KvBlocksRemoved
    | KvCleared
    | WorkerLoadReported
    | RolesRebalanced
    | PlannerConfigured,
    Field(discriminator="type"),
]
TerminalEvent = RequestFinished | RequestFailed | RequestCancelled
KvEvent = KvBlocksStored | KvBlocksRemoved | KvCleared
