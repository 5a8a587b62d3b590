"""What a routing decision records beside its choice (``RouteDecided``): every candidate weighed,
with all the planner knew of it, and the KV moves and prefill placements it considered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.control_events import StepCost
from schemas.envelope import Frozen


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
    step_cost: StepCost | None = Field(
        default=None, description="its measured step times; none: the planner's perf model"
    )
    kv_bytes_per_token: int = Field(
        default=0, ge=0, description="bytes of KV a token takes there (0: the planner's setting)"
    )
    lora_resident: bool | None = Field(
        default=None,
        description="the request's LoRA adapter was resident there (False: its load was "
        "predicted); None: the request has no adapter",
    )
    lora_loads_ahead: int = Field(
        default=0, ge=0, description="LoRA adapter loads the requests queued there make first"
    )


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
