"""The step-driven engine protocol that the live workers and the offline simulator both drive.

An engine does no I/O of Laneway's: ``step`` runs one scheduler iteration and says how long it took
(measured for a real engine, modelled for ``sim``). The caller decides what to do with modelled
time: the live worker waits it out (divided by a speed-up), the offline simulator advances its
clock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

from schemas.block_hash import ROOT_HASH
from schemas.events import KvTier, SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    # Chained hashes of the prompt's full blocks at the engine's block size; empty means
    # "compute them yourself".
    block_hashes: tuple[int, ...] = ()
    # The parent of the first block's hash: the request's cache salt (schemas.block_hash.
    # salt_root), for the blocks the engine hashes itself (all of them where ``block_hashes``
    # is empty, the answer's always), so that they join the same salted chain.
    root_hash: int = ROOT_HASH
    # The LoRA adapter it runs with (None: the base model), and the folder an engine loads it
    # from (a real engine's; the sim's adapters are modelled).
    lora: str | None = None
    lora_path: str | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: Literal["stop", "length"] | None = None
    # Set on the first output of a request: prompt tokens found in the prefix cache.
    cached_tokens: int | None = None
    # Where the request asked for log probabilities (``SamplingParams.logprobs``): one for each
    # of ``new_token_ids``.
    logprobs: tuple[Logprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class Logprobs:
    """A generated token's log probability, and the most likely tokens at its position (id and
    log probability, most likely first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    tier: KvTier = "gpu"


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]
    tier: KvTier = "gpu"


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


KvChange = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    waiting_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    # The LoRA adapters resident, least recently used first, as the planner's view of the
    # worker reads them (services.planner.adapters).
    loras: tuple[str, ...] = ()


@dataclass(slots=True)
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    kv_changes: list[KvChange] = field(default_factory=list)
    # Wall time the step takes on the modelled (sim) or real hardware, in seconds.
    duration_s: float = 0.0
    # New prompt tokens computed in this step (not served from cache).
    prefill_tokens: int = 0
    # A result of several decode steps at once (:class:`DecodeRuns`): each step's end, seconds
    # from the first one's start; every output holds one token of each step, and ``duration_s``
    # is the last end. Empty for one step.
    step_ends_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine does beyond the calls every engine answers. The worker reads it once, to
    register what it offers and to pick how it drives the engine, instead of probing methods."""

    # ``export_prefix``/``import_prefix`` work (:class:`KvPortable`): the engine can be either side
    # of a disaggregated hand-off. Workers register ``kv_handoff`` with it, and the planner sends
    # remote prefills only between workers that have it.
    kv_handoff: bool
    # ``step`` reports every change to its prefix cache in ``kv_changes``. Without it the worker
    # registers ``kv_events=False`` and the kv-indexer predicts this engine's cache from routing.
    kv_events: bool
    # ``step`` returns at once and its ``duration_s`` is modelled time that the caller waits out
    # (the sim engine). Without it a step computes on real hardware and holds the caller for its
    # duration, so the worker runs steps on a thread of their own to keep its event loop free.
    modelled_time: bool
    # A hand-off carries the whole prompt's KV, its partial last block's included, and
    # ``add_handed_off`` (:class:`WholePromptHandoff`) continues the request from its first token
    # with nothing recomputed. Without it only full blocks travel, and the decode engine
    # recomputes the partial last block with the first token.
    whole_prompt_handoff: bool = False
    # ``run_steps`` (:class:`DecodeRuns`) does plain decode steps many at once, with the tokens,
    # KV changes and times stepping them one by one gives (the sim engine's decode runs).
    decode_runs: bool = False
    # ``add_request`` takes a request with a ``structured_output`` and its answer has that shape
    # (vLLM's structured outputs). Workers register it, and the ingress refuses such a request
    # for a model any of whose workers lacks it; an engine without it refuses the request
    # itself too (:func:`refuse_unsupported`).
    structured_outputs: bool = False
    # ``step`` gives each token's log probability and the most likely tokens at its position
    # where a request's ``SamplingParams.logprobs`` asks (vLLM's). Workers register it, and the
    # ingress refuses such a request for a model any of whose workers lacks it; an engine
    # without it refuses the request itself too (:func:`refuse_unsupported`).
    logprobs: bool = False
    # Bytes a token's KV takes in this engine's cache, every layer's K and V: what a KV move or
    # hand-off of its prompts carries. Workers register it, and the planner prices moves with
    # it. 0: unknown (the planner's configured size stands in).
    kv_bytes_per_token: int = 0
    # LoRA adapters it holds at once (``EngineRequest.lora``, loaded on demand, least recently
    # used out beyond; ``EngineLoad.loras`` says which). 0: it serves none, and refuses a
    # request with one (:func:`refuse_unsupported`). Workers register it, and the planner sends
    # an adapter's requests only to workers that hold adapters.
    max_loras: int = 0


def refuse_adapter(request: EngineRequest, engine: str, max_loras: int) -> None:
    """ValueError for a request with a LoRA adapter where the engine holds none."""
    if request.lora is not None and not max_loras:
        raise ValueError(
            f"request {request.request_id} runs with the LoRA adapter {request.lora!r}, and this "
            f"{engine} engine holds no adapters (the sim and vllm engines do, with "
            "LANEWAY_MAX_LORAS set)"
        )


def refuse_unsupported(request: EngineRequest, engine: str, max_loras: int = 0) -> None:
    """ValueError for a request that asks for what only the vllm engine does: a response_format
    (answered as free text it would break the client's parser) or log probabilities; or for a
    LoRA adapter where the engine holds none (``max_loras``)."""
    refuse_adapter(request, engine, max_loras)
    wanted = request.sampling.structured_output
    if wanted is not None:
        raise ValueError(
            f"request {request.request_id} asks for response_format {wanted.type}, and the "
            f"{engine} engine does no structured outputs (the vllm engine does)"
        )
    if request.sampling.logprobs is not None:
        raise ValueError(
            f"request {request.request_id} asks for log probabilities, and the {engine} engine "
            "gives none (the vllm engine does)"
        )


def checked_prompt(
    request: EngineRequest, held: Container[str], max_positions: int, bound: str
) -> list[int]:
    """The prompt of ``request``, for an engine (over another's scheduler) holding ``held``
    request ids and ``max_positions`` positions a request; ValueError, so that this request
    alone fails, for an id held already, an empty prompt or too many positions. ``bound``: what
    holds the positions, for the message."""
    request_id = request.request_id
    if request_id in held:
        raise ValueError(f"request {request_id} is already in the engine")
    prompt = list(request.prompt_token_ids)
    if not prompt:
        raise ValueError(f"request {request_id} has an empty prompt")
    if len(prompt) + request.sampling.max_tokens > max_positions:
        raise ValueError(
            f"request {request_id} needs {len(prompt)} + {request.sampling.max_tokens} "
            f"positions, more than the engine's {bound} hold ({max_positions})"
        )
    return prompt


class Engine(Protocol):
    """One model replica's batch scheduler and executor, driven one step at a time by a single
    caller (the live worker or the offline replay); never called from two threads at once."""

    # Tokens per KV block: requests' ``block_hashes`` and ``KvChange`` hashes are at this size.
    block_size: int
    # The KV pool's size in blocks, as registered for the planner's cost model.
    kv_blocks_total: int
    # Most requests one step decodes together, as registered for the planner.
    max_num_seqs: int
    # Most tokens, prompt and completion together, one request may have: what both its context
    # (positions) and its KV pool hold. Registered for the ingress's context-length check;
    # ``add_request`` takes every request within it.
    max_model_len: int

    @property
    def capabilities(self) -> EngineCapabilities:
        """What this engine offers beyond this protocol; fixed for the engine's lifetime."""
        ...

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; later steps prefill and decode it. Called when the worker accepts a
        routed request (or a hand-off's continuation). Raises ValueError, before queueing
        anything, for a request the engine can never serve (an id it already holds, an empty
        prompt, more tokens than its context or KV pool can hold), so that the caller fails that
        request alone instead of the engine stalling on it."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; no later step reports output for it. Called when
        the client cancels, a stop string matched, or the worker gives the request up. False if
        the engine does not hold the request (never added, finished or already aborted)."""
        ...

    def step(self) -> StepResult:
        """Run one scheduler iteration and report it: for each request, the tokens it produced in
        order (a request's last output has ``finished`` set and none follows it; its first output
        carries ``cached_tokens``), the prefix cache's changes in order, and the step's duration.
        Called in a loop while :meth:`has_work` says so; the caller, not the engine, does any
        waiting. A step with nothing scheduled returns at once with no outputs."""
        ...

    def has_work(self) -> bool:
        """Whether another step would make progress: requests are held, or (for an engine that
        computes asynchronously) output or KV changes are still to come. The worker steps while
        it is true and sleeps until new work arrives otherwise."""
        ...

    def load(self) -> EngineLoad:
        """The engine's queue and KV occupancy now; cheap. Read after steps for the load reports
        the planner's cost model uses."""
        ...


class KvPortable(Protocol):
    """An engine whose cached prompt blocks can move to another engine of the same model: a
    prefill worker exports, a decode worker imports (disaggregation). Only an engine whose
    ``capabilities.kv_handoff`` is set has these; :func:`kv_portable` gives that view of it."""

    def export_prefix(self, block_hashes: Sequence[int]) -> tuple[int, bytes]:
        """The leading blocks of ``block_hashes`` held here (in the prefix cache, then in a host
        tier if the engine has one): how many, and their KV serialized (empty for an engine that
        only models its KV). Called by a prefill worker once a request's prompt is computed, to
        ship its KV to the decode worker, and by a KV move's source."""
        ...

    def import_prefix(self, block_hashes: Sequence[int], payload: bytes) -> int:
        """Cache the blocks another engine exported (``payload`` from its ``export_prefix``); how
        many leading ``block_hashes`` are cached afterwards. Called by a decode worker before it
        adds the hand-off's continuation, so that the request finds its prompt cached. Their
        ``BlocksStored`` changes come with the next step's result."""
        ...


class WholePromptHandoff(Protocol):
    """An engine that takes a hand-off's whole prompt (``capabilities.whole_prompt_handoff``)."""

    def add_handed_off(self, request: EngineRequest, prompt_tokens: int) -> None:
        """Queue a hand-off's continuation whose first ``prompt_tokens`` tokens (the original
        prompt) another engine computed; their KV was imported with :meth:`KvPortable.import_prefix`
        first. The next decode step consumes the rest (the first token). Called by a decode worker
        instead of ``add_request``; raises ValueError as ``add_request`` does."""
        ...


class ModelledKvMove(Protocol):
    """An engine whose KV is modelled (``capabilities.modelled_time`` with ``kv_handoff``): a KV
    move brings it no bytes, so it waits out the move's modelled transfer itself."""

    def expect_transfer(self, request_id: str, transfer_ms: float) -> None:
        """The request added next under ``request_id`` brings KV imported just before over a
        link that takes ``transfer_ms`` (modelled): the step that first schedules it waits that
        out. Called by a KV move's target right before it adds the request."""
        ...


class DecodeRuns(Protocol):
    """An engine that steps plain decode steps many at once (``capabilities.decode_runs``)."""

    def run_steps(self, until_s: float) -> StepResult | None:
        """The steps that begin within ``until_s`` seconds (modelled) from now, at least the
        first, as one result (see ``StepResult.step_ends_s``), when they are plain decode steps:
        no request waits, each running one decodes, none may stop on a token. None, with
        nothing changed, when the next step is not one: :meth:`Engine.step` then does it."""
        ...


def decode_runs(engine: Engine) -> DecodeRuns | None:
    """The engine's way to step many decode steps at once, or None if it has none."""
    if not engine.capabilities.decode_runs:
        return None
    return cast(DecodeRuns, engine)


def modelled_kv_move(engine: Engine) -> ModelledKvMove | None:
    """The engine's way to model a KV move's transfer, or None if its KV is real."""
    capabilities = engine.capabilities
    if not (capabilities.modelled_time and capabilities.kv_handoff):
        return None
    return cast(ModelledKvMove, engine)


def whole_prompt_handoff(engine: Engine) -> WholePromptHandoff | None:
    """The engine's way to continue a whole-prompt hand-off, or None if it has none."""
    if not engine.capabilities.whole_prompt_handoff:
        return None
    return cast(WholePromptHandoff, engine)


def kv_portable(engine: Engine) -> KvPortable | None:
    """The engine's KV hand-off interface, or None if its capabilities say it has none."""
    if not engine.capabilities.kv_handoff:
        return None
    return cast(KvPortable, engine)
