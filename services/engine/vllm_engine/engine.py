"""``VllmEngine``: vLLM's engine, in the worker's own process, behind the step-driven ``Engine``
protocol.

vLLM's ``LLMEngine`` is already step-driven (``add_request``, ``step``, ``abort_request``): with
multiprocessing off its engine core runs in this process, and each ``step`` schedules and runs one
batch. What a step produced comes as each request's new tokens (``RequestOutputKind.DELTA``), its
first output with vLLM's own count of prompt tokens found in its prefix cache. vLLM's KV events
(``BlockStored`` with each block's tokens, ``BlockRemoved``, ``AllBlocksCleared``) are taken from
its scheduler in the same process, where vLLM hands each step's batch to its event publisher, and
hashed again with Laneway's chained hash (:mod:`services.engine.kv_translate`), the request's
cache salt included: vLLM gets the salt as its own ``cache_salt``, and reports it with the first
block of a prompt. A disaggregated hand-off's KV leaves through vLLM's prefix cache and comes in
through Laneway's KV connector (:mod:`services.engine.vllm_engine.connector`).

``vllm`` is imported only when an engine is opened, so this module imports anywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Literal, cast

from schemas.block_hash import ROOT_HASH
from schemas.events import SamplingParams, StructuredOutput
from services.engine.kv_translate import KvHashes
from services.engine.protocol import (
    EngineCapabilities,
    EngineLoad,
    EngineRequest,
    KvChange,
    Logprobs,
    RequestOutput,
    StepResult,
    checked_prompt,
)
from services.engine.vllm_engine.adapters import VllmAdapters
from services.engine.vllm_engine.config import VllmEngineConfig

_GIB = 1 << 30


class VllmEngine:
    """The ``Engine`` protocol over one in-process vLLM engine; one caller drives it."""

    def __init__(self, config: VllmEngineConfig) -> None:
        # The engine core in this process: its steps are this object's, and its scheduler's KV
        # events reach us without a socket.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # Its KV events name blocks by its own hashes, not by their low 64 bits: the keys of its
        # prefix cache, where an export looks blocks up.
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
        from services.engine.vllm_engine.compat import import_vllm

        import_vllm()
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt
        from vllm.outputs import RequestOutput as VllmOutput
        from vllm.v1.engine.llm_engine import LLMEngine

        from services.engine.vllm_engine import connector

        connector.register()
        # What a hand-off brings waits here for vLLM's scheduler to load it.
        self._stage = connector.KvStage()
        self._prompt = TokensPrompt
        self._output = VllmOutput
        self._invalid = VLLMValidationError

        arguments: dict[str, Any] = {
            "model": str(config.model_dir),
            "block_size": config.block_size,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "dtype": config.dtype,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "enable_prefix_caching": True,
            # Recorded by its KV cache manager; the "null" publisher is replaced below.
            "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            # Hand-offs' KV comes in through Laneway's connector (another connector given in
            # ``extra_args``, NIXL's say, replaces it, and hand-offs through Laneway with it).
            "kv_transfer_config": KVTransferConfig(
                kv_connector=connector.CONNECTOR,
                kv_role="kv_both",
                kv_connector_extra_config={connector.STAGE_ID: self._stage.id},
                # A staged block gone before its load is recomputed, not the request failed.
                kv_load_failure_policy="recompute",
            ),
            "disable_log_stats": True,
            **config.extra_args,
        }
        if config.kv_cache_gib is not None:
            arguments["kv_cache_memory_bytes"] = int(config.kv_cache_gib * _GIB)
        if config.max_loras:
            from services.engine.vllm_engine.lora_rows import mend_cpu_lora_rows

            mend_cpu_lora_rows()
            arguments = {"enable_lora": True, "max_loras": config.max_loras, **arguments}
        self._adapters = VllmAdapters(config.max_loras)
        self._engine = LLMEngine.from_engine_args(EngineArgs(**arguments))
        # With multiprocessing off its client is an InprocClient, which holds the engine core.
        core = cast(Any, self._engine.engine_core).engine_core
        self._scheduler = core.scheduler
        self._events: list[Any] = []
        self._scheduler.kv_event_publisher = _Collect(self._events)
        vllm_config = core.vllm_config
        cache = vllm_config.cache_config
        self.block_size = int(cache.block_size)
        # vLLM keeps one block of its pool aside (its null block): the rest hold tokens.
        self.kv_blocks_total = int(cache.num_gpu_blocks) - 1
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.capabilities = EngineCapabilities(
            kv_handoff=self._attach_stage(core),
            kv_events=True,
            modelled_time=False,
            structured_outputs=True,
            logprobs=True,
            kv_bytes_per_token=self._kv_bytes_per_token(core),
            max_loras=config.max_loras,
        )
        self._sampling = _sampling_class()
        self._hashes = KvHashes(self.block_size)
        # Requests held, and whether each has produced its first output yet.
        self._started: dict[str, bool] = {}
        # The requests that asked for log probabilities, and how many most likely tokens.
        self._top: dict[str, int] = {}

    # -- the Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        request_id = request.request_id
        # vLLM checks at start that its KV blocks hold max_model_len tokens: it bounds both.
        prompt = checked_prompt(request, self._started, self.max_model_len, "context and KV blocks")
        sampling = request.sampling
        if sampling.structured_output is not None and sampling.offset:
            # vLLM's grammar starts at the answer's first token, and a continuation's earlier
            # tokens come as prompt, which it does not match: sampled on from a fresh grammar,
            # the rest would not fit what came before.
            raise ValueError(
                f"request {request_id} continues an answer with response_format "
                f"{sampling.structured_output.type} after {sampling.offset} tokens, and vLLM "
                "cannot resume its structured output mid-answer: retry the request"
            )
        inputs = self._prompt(prompt_token_ids=prompt)
        if request.root_hash != ROOT_HASH:
            inputs["cache_salt"] = _salt_of(request.root_hash)
        adapter = self._adapters.request_of(request, self._engine)
        try:
            self._engine.add_request(
                request_id, inputs, self._sampling(sampling), lora_request=adapter
            )
        except self._invalid as err:  # a schema its structured-output backend refuses
            raise ValueError(f"request {request_id}: {err}") from err
        self._started[request_id] = False
        if sampling.logprobs is not None:
            self._top[request_id] = sampling.logprobs

    def abort(self, request_id: str) -> bool:
        self._top.pop(request_id, None)
        if self._started.pop(request_id, None) is None:
            return False
        self._engine.abort_request([request_id])
        return True

    def step(self) -> StepResult:
        started = time.perf_counter()
        outputs: list[RequestOutput] = []
        prefill_tokens = 0
        for out in self._engine.step():
            request_id = out.request_id
            first = self._started.get(request_id)
            if first is None or not isinstance(out, self._output):
                continue  # aborted meanwhile (a generating engine has no pooling outputs)
            completion = out.outputs[0]
            reason = _finish_reason(completion.finish_reason) if out.finished else None
            if out.finished and reason is None:
                self._started.pop(request_id, None)  # aborted by vLLM itself: nothing to say
                self._top.pop(request_id, None)
                continue
            cached = None
            if not first:
                self._started[request_id] = True
                cached = int(out.num_cached_tokens or 0)
                prefill_tokens += max(0, len(out.prompt_token_ids or ()) - cached)
            ids = tuple(completion.token_ids)
            top = self._top.get(request_id)
            logprobs = () if top is None else _logprobs(ids, completion.logprobs or (), top)
            outputs.append(RequestOutput(request_id, ids, out.finished, reason, cached, logprobs))
            if out.finished:
                del self._started[request_id]
                self._top.pop(request_id, None)
        return StepResult(
            outputs=outputs,
            kv_changes=self._kv_changes(),
            duration_s=time.perf_counter() - started,
            prefill_tokens=prefill_tokens,
        )

    def has_work(self) -> bool:
        return bool(self._engine.has_unfinished_requests()) or bool(self._events)

    def load(self) -> EngineLoad:
        """From vLLM's scheduler: its queues, the prompt tokens still to compute, and the KV
        blocks not free."""
        scheduler = self._scheduler
        waiting = list(scheduler.waiting)
        running = list(scheduler.running)
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        return EngineLoad(
            running=len(running),
            waiting=len(waiting),
            waiting_prefill_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*waiting, *running)
            ),
            kv_blocks_used=max(0, self.kv_blocks_total - free),
            kv_blocks_total=self.kv_blocks_total,
            loras=self._adapters.held(self._engine),
        )

    # -- KV hand-off (KvPortable) -----------------------------------------------------------

    def export_prefix(self, block_hashes: Sequence[int]) -> tuple[int, bytes]:
        """The leading blocks in vLLM's prefix cache, read from its KV cache."""
        block_ids = self._cached_block_ids(block_hashes)
        return len(block_ids), self._stage.export(block_hashes[: len(block_ids)], block_ids)

    def import_prefix(self, block_hashes: Sequence[int], payload: bytes) -> int:
        """Staged, not yet cached: vLLM's scheduler loads them into its cache (and announces
        them) when it schedules the request they lead, which the caller adds right after."""
        staged = self._stage.stage(payload, block_hashes)
        return staged + len(self._cached_block_ids(block_hashes[staged:]))

    def _cached_block_ids(self, block_hashes: Sequence[int]) -> list[int]:
        """vLLM's block ids of the leading ``block_hashes`` its prefix cache holds."""
        pool = self._scheduler.kv_cache_manager.block_pool
        block_ids: list[int] = []
        for ours in block_hashes:
            theirs = self._hashes.engine_hash(ours)
            blocks = None if theirs is None else pool.get_cached_block(theirs, [0])
            if not blocks:
                break
            block_ids.append(blocks[0].block_id)
        return block_ids

    def _kv_bytes_per_token(self, core: Any) -> int:
        """One token's KV in every layer's cache tensor (each holds its blocks first)."""
        forward = core.vllm_config.compilation_config.static_forward_context
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        layers = [forward[name].kv_cache for group in groups for name in group.layer_names]
        return sum(int(t[0].numel()) * int(t.element_size()) for t in layers) // self.block_size

    def _attach_stage(self, core: Any) -> bool:
        """Give the stage vLLM's KV cache; whether hand-offs can go through it: Laneway's
        connector is vLLM's, and the model's layers share one KV cache group."""
        from services.engine.vllm_engine.connector import CONNECTOR

        transfer = core.vllm_config.kv_transfer_config
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        if transfer is None or transfer.kv_connector != CONNECTOR or len(groups) != 1:
            return False
        forward = core.vllm_config.compilation_config.static_forward_context
        self._stage.attach(
            [forward[name].kv_cache for name in groups[0].layer_names], self.kv_blocks_total
        )
        return True

    # -- vLLM's KV events -------------------------------------------------------------------

    def _kv_changes(self) -> list[KvChange]:
        batches = self._events[:]
        self._events.clear()
        changes: list[KvChange] = []
        for batch in batches:
            for event in batch.events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    changes += self._stored(event)
                elif kind == "BlockRemoved":
                    changes += self._hashes.removed(event.block_hashes)
                elif kind == "AllBlocksCleared":
                    changes += self._hashes.cleared()
        return changes

    def _stored(self, event: Any) -> list[KvChange]:
        size = int(event.block_size)
        tokens = list(event.token_ids)
        blocks = [(h, tokens[i * size : (i + 1) * size]) for i, h in enumerate(event.block_hashes)]
        root = ROOT_HASH
        if event.parent_block_hash is None and event.extra_keys and event.extra_keys[0]:
            root = _root_of(event.extra_keys[0])
        return self._hashes.stored(event.parent_block_hash, blocks, root)


class _Collect:
    """vLLM's event publisher, replaced: each step's batch kept for ``step`` to take."""

    def __init__(self, into: list[Any]) -> None:
        self._into = into

    def publish(self, batch: Any) -> None:
        self._into.append(batch)

    def shutdown(self) -> None:
        return None


def _salt_of(root: int) -> str:
    """The cache salt vLLM gets for a request whose chain starts at ``root``: the root itself,
    so that a stored prompt's first block says where its chain starts."""
    return f"laneway:{root:016x}"


def _root_of(extra_keys: tuple[Any, ...]) -> int:
    # The salt comes last: a LoRA adapter's name, which may look like one, comes before it.
    for key in reversed(extra_keys):
        if isinstance(key, str) and key.startswith("laneway:"):
            return int(key.removeprefix("laneway:"), 16)
    return ROOT_HASH


def _logprobs(ids: tuple[int, ...], positions: Sequence[Any], top: int) -> tuple[Logprobs, ...]:
    """vLLM's log probabilities of the new tokens ``ids`` (a delta output's): at each position
    the sampled token's, and the ``top`` most likely (vLLM gives those and the sampled token,
    each with its rank)."""
    out = []
    for token_id, position in zip(ids, positions, strict=True):
        ranked = sorted(position.items(), key=lambda item: item[1].rank)[:top]
        out.append(
            Logprobs(
                float(position[token_id].logprob),
                tuple((t, float(p.logprob)) for t, p in ranked),
            )
        )
    return tuple(out)


def _finish_reason(reason: str | None) -> Literal["stop", "length"] | None:
    return reason if reason in ("stop", "length") else None  # type: ignore[return-value]


def _sampling_class() -> Any:
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    def structured(wanted: StructuredOutput | None) -> Any:
        if wanted is None:
            return None
        if wanted.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        return StructuredOutputsParams(json=wanted.json_schema)

    def make(sampling: SamplingParams) -> Any:
        """Stop strings are left out: the worker cuts them from the text and aborts."""
        return VllmSampling(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            structured_outputs=structured(sampling.structured_output),
            logprobs=sampling.logprobs,
        )

    return make
