"""Messages that are not events: request/reply bodies and etcd records."""

from __future__ import annotations

from pydantic import Field

from schemas.events import (
    BlockHashes,
    Frozen,
    KvPayload,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    Role,
    TokensGenerated,
)


class OverlapQuery(Frozen):
    """Ask the kv-indexer how much of a prompt each worker already caches."""

    block_hashes: BlockHashes = Field(description="chained hashes of the prompt's full blocks")


class OverlapReply(Frozen):
    """Per worker, the number of leading query blocks it caches; workers with none are absent."""

    overlaps: dict[str, int]
    indexed_blocks: int = Field(ge=0, description="distinct (worker, block) pairs in the index")
    host_runs: dict[str, int] = Field(
        default_factory=dict,
        description="per worker with a host tier, the blocks after its GPU overlap that tier "
        "holds in a row (loaded, not recomputed); workers with none are absent",
    )


# Queries in one batch at most: a planner asks those of one turn of its event loop together.
OVERLAP_BATCH_LIMIT = 256


class OverlapQueries(Frozen):
    """Several prompts' overlap queries in one message, answered in one."""

    queries: tuple[OverlapQuery, ...] = Field(min_length=1, max_length=OVERLAP_BATCH_LIMIT)


class OverlapReplies(Frozen):
    """The answers to an :class:`OverlapQueries`, in its order."""

    replies: tuple[OverlapReply, ...] = Field(max_length=OVERLAP_BATCH_LIMIT)


# The model a worker serves, and the ingress's one name, when neither is told another.
DEFAULT_MODEL = "laneway-sim"


class WorkerRegistration(Frozen):
    """A worker's record in etcd (`workers/<id>`), alive as long as its lease."""

    worker_id: str
    role: Role
    engine: str = Field(description="engine kind: sim, torch, trtllm, vllm")
    model: str = Field(description="served model name")
    block_size: int = Field(gt=0, description="tokens per KV block")
    kv_blocks_total: int = Field(gt=0, description="KV cache capacity, in blocks")
    max_num_seqs: int = Field(gt=0, description="most requests it runs at once")
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="most tokens, prompt and completion together, of a request it takes "
        "(None: a record from before workers registered it)",
    )
    kv_events: bool = Field(default=True, description="publishes KV events (else: approximate)")
    kv_handoff: bool = Field(
        default=False, description="its engine can send and take a prompt's KV (disaggregation)"
    )
    structured_outputs: bool = Field(
        default=False,
        description="its engine enforces a response_format (JSON Schema, JSON object) while "
        "sampling",
    )
    logprobs: bool = Field(
        default=False,
        description="its engine gives each token's log probability and the most likely tokens "
        "at its position",
    )
    max_loras: int = Field(
        default=0, ge=0, description="LoRA adapters it holds at once (0: it serves none)"
    )
    kv_bytes_per_token: int = Field(
        default=0,
        ge=0,
        description="bytes a token's KV takes in its engine, every layer's K and V (0: unknown, "
        "the planner's LANEWAY_KV_BYTES_PER_TOKEN)",
    )
    draining: bool = Field(
        default=False, description="finishing in-flight work before a role change; takes none new"
    )
    pid: int = Field(description="OS process id, for operators")
    node: str = Field(default="", max_length=128, description="the node it runs on ('' unknown)")
    rack: str = Field(default="", max_length=128, description="the node's rack ('' unknown)")


class IndexStateQuery(Frozen):
    """Ask one kv-indexer replica for a digest of its index."""


class IndexState(Frozen):
    """A digest of one replica's index: equal digests, equal indexes."""

    indexed_blocks: int = Field(ge=0, description="distinct (worker, block) pairs")
    digest: str = Field(description="hash over every (worker, block) pair, order-free")
    position: int = Field(ge=0, description="KV stream position folded up to")
    restored_from: int = Field(ge=0, description="snapshot position it started from, 0: none")
    blocks_per_worker: dict[str, int] = Field(description="indexed blocks of each worker")
    duplicates: int = Field(ge=0, description="redelivered KV events ignored since start")
    gaps: int = Field(ge=0, description="missing KV events skipped since start")


class ResendQuery(Frozen):
    """Ask the worker that holds a request for its published events from token ``index`` on."""

    request_id: str = Field(max_length=64)
    index: int = Field(ge=0, description="the first token the asker is missing")
    attempt: int = Field(default=0, ge=0, description="the request's attempt asked about")


class ResendReply(Frozen):
    """The holder's answer: the batches it kept from ``index`` on (a batch may start before
    it), and the terminal event once the request ended. ``complete``: no kept token was left
    out (the reply is bounded; the asker asks again from where it got to)."""

    batches: tuple[TokensGenerated, ...]
    terminal: RequestFinished | RequestFailed | RequestCancelled | None = Field(
        default=None, discriminator="type"
    )
    complete: bool = True


class KvPullQuery(Frozen):
    """A worker the planner sent a request with a KV move asks the worker holding the prompt's KV
    for its leading blocks (GPU or host tier); the chunks come on the asker's hand-off subject."""

    request_id: str = Field(max_length=64)
    attempt: int = Field(default=0, ge=0, description="the request's attempt that moves")
    to_worker_id: str = Field(max_length=64, description="the asker: where the chunks go")
    block_hashes: BlockHashes = Field(
        min_length=1, max_length=65_536, description="the leading prompt blocks wanted"
    )


class KvPullReply(Frozen):
    """The holder's answer, once its chunks are sent: how many leading blocks it sends (those it
    holds, at most those asked), or why none."""

    blocks: int = Field(ge=0, description="leading blocks of the query sent")
    payload: KvPayload | None = Field(
        default=None, description="the chunks' count, size and checksum; None: modelled KV"
    )
    error: str | None = Field(default=None, max_length=512, description="why nothing is sent")
