"""Every event of ARCHITECTURE.md §2: one envelope, frozen payload models, documented units.

Events are immutable facts. A field's meaning never changes once published: a new meaning gets a
new ``schema_version`` and an upcaster in :mod:`schemas.codec`. The request path's events are
defined here; the envelope is :mod:`schemas.envelope`; a worker's KV cache changes are
:mod:`schemas.kv_events`, the control plane's :mod:`schemas.control_events`, what an ingress hears
on core NATS :mod:`schemas.live_events`. This module names them all.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from schemas.control_events import (
    CapacityReviewed,
    LoraName,
    PlannerConfigured,
    RoleMove,
    RolesRebalanced,
    StepCost,
    WorkerLoadReported,
)
from schemas.envelope import (
    BlockHashes,
    Envelope,
    FinishReason,
    Frozen,
    KvTier,
    Role,
    TokenIds,
    TraceContext,
    attempt_field,
    model_field,
    new_id,
    tenant_field,
    utc_now,
)
from schemas.kv_events import (
    CacheWiped,
    KvBlocksRemoved,
    KvBlocksStored,
    KvChanged,
    KvCleared,
    KvOp,
    RemovedRun,
    StoredRun,
)
from schemas.latency import LatencyHistogram
from schemas.live_events import RequestPlaced, TokenBatch, TokenRun
from schemas.logprobs import TokenLogprob
from schemas.route_parts import KvMove, PrefillPlacement, RouteCandidate, TtftAlternative
from schemas.sampling import SamplingParams, StructuredOutput

# A worker's id, as a request names one (64 characters, as every worker id the bus carries).
WORKER_NAME_MAX = 64
WorkerName = Annotated[str, StringConstraints(min_length=1, max_length=WORKER_NAME_MAX)]


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
    priority: Literal["high", "normal", "low"] = Field(
        default="normal",
        description="admission control's class: the kv policy weighs a first token's delay by it",
    )
    cache_salt: str | None = Field(None, max_length=64, description="the salt of its block hashes")
    lora: LoraName | None = Field(None, description="its LoRA adapter; None: the base model")
    lora_path: str | None = Field(None, max_length=4096, description="where workers load `lora`")
    avoid_workers: tuple[WorkerName, ...] = Field(
        default=(),
        max_length=8,
        description="workers earlier attempts left (gone, silent, or answering too slowly): the "
        "planner routes the attempt to another while one can take it",
    )

    @property
    def prompt_length(self) -> int:
        """Tokens in the prompt, whether or not its ids are here."""
        return len(self.prompt_token_ids) if self.prompt_tokens is None else self.prompt_tokens


class RequestAccepted(Envelope):
    """Ingress validated a client request and handed it to the planner."""

    type: Literal["RequestAccepted"] = "RequestAccepted"
    spec: RequestSpec


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
    attempt: int = attempt_field()
    logprobs: tuple[TokenLogprob, ...] = Field(
        default=(), description="one for each of `token_ids` where the request asked for them"
    )


class Usage(Frozen):
    """Token counts, as OpenAI reports them."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0, description="prompt tokens served from KV cache")


class RequestFinished(Envelope):
    """Terminal: the request completed normally."""

    type: Literal["RequestFinished"] = "RequestFinished"
    worker_id: str
    attempt: int = attempt_field()
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
    tenant: str | None = tenant_field()
    model: str | None = model_field()


FailureCode = Literal[
    "worker_lost", "engine_error", "no_worker", "invalid_request", "timeout", "incomplete_stream"
]


class RequestFailed(Envelope):
    """Terminal: the request cannot complete."""

    type: Literal["RequestFailed"] = "RequestFailed"
    code: FailureCode
    attempt: int = attempt_field()
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
    attempt: int = attempt_field()
    reason: str
    completion_tokens: int = Field(default=0, ge=0, description="tokens generated before the stop")
    prompt_tokens: int = Field(default=0, ge=0, description="its prompt, where it was computed")
    cached_tokens: int = Field(default=0, ge=0, description="of those, served from KV cache")
    tenant: str | None = tenant_field()
    model: str | None = model_field()


Event = Annotated[
    RequestAccepted
    | RouteDecided
    | PrefillCompleted
    | KvTransferred
    | TokensGenerated
    | TokenBatch
    | RequestFinished
    | RequestFailed
    | CancellationRequested
    | RequestCancelled
    | KvBlocksStored
    | KvBlocksRemoved
    | KvCleared
    | KvChanged
    | WorkerLoadReported
    | RolesRebalanced
    | CapacityReviewed
    | PlannerConfigured
    | RequestPlaced,
    Field(discriminator="type"),
]
TerminalEvent = RequestFinished | RequestFailed | RequestCancelled
KvEvent = KvBlocksStored | KvBlocksRemoved | KvCleared | KvChanged


__all__ = [
    "BlockHashes",
    "CacheWiped",
    "CancellationRequested",
    "CapacityReviewed",
    "Envelope",
    "Event",
    "FailureCode",
    "FinishReason",
    "Frozen",
    "KvBlocksRemoved",
    "KvBlocksStored",
    "KvChanged",
    "KvCleared",
    "KvEvent",
    "KvMove",
    "KvOp",
    "KvPayload",
    "KvTier",
    "KvTransferred",
    "LoraName",
    "PlannerConfigured",
    "PrefillCompleted",
    "PrefillPlacement",
    "RemovedRun",
    "RequestAccepted",
    "RequestCancelled",
    "RequestFailed",
    "RequestFinished",
    "RequestPlaced",
    "RequestSpec",
    "Role",
    "RoleMove",
    "RolesRebalanced",
    "RouteCandidate",
    "RouteDecided",
    "SamplingParams",
    "StepCost",
    "StoredRun",
    "StructuredOutput",
    "TerminalEvent",
    "TokenBatch",
    "TokenIds",
    "TokenRun",
    "TokensGenerated",
    "TraceContext",
    "TtftAlternative",
    "Usage",
    "WorkerLoadReported",
    "new_id",
    "utc_now",
]
