"""``TrtllmEngine``: TensorRT-LLM's LLM API behind the step-driven ``Engine`` protocol.

Laneway's protocol wants a synchronous ``step`` that reports what happened; TensorRT-LLM runs its
own iterations and streams their results to an :class:`LlmSession` on a thread of its own. ``step``
drains the session's updates without blocking (waiting a moment only when there are none), folds
them into per-request outputs and KV changes, and reports the wall time it took.

``tensorrt_llm`` is imported only when an engine is opened, so this module imports anywhere.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Literal

from services.common.hf_tokenizer import HfTokenizer
from services.engine.protocol import (
    EngineCapabilities,
    EngineLoad,
    EngineRequest,
    KvChange,
    RequestOutput,
    StepResult,
    checked_prompt,
    refuse_unsupported,
)
from services.engine.trtllm_engine.config import TrtllmEngineConfig, TrtllmError
from services.engine.trtllm_engine.kv_events import KvEventTranslator
from services.engine.trtllm_engine.llm_api import (
    LlmOpener,
    max_positions,
    open_trtllm,
    sampling_kwargs,
)
from services.engine.trtllm_engine.session import Failed, KvEvent, LlmSession, Tokens, Update


@dataclass(slots=True)
class _Request:
    prompt_len: int
    generated: int = 0
    started: bool = False


@dataclass(slots=True)
class _StepOutput:
    token_ids: list[int]
    finished: bool = False
    finish_reason: Literal["stop", "length"] | None = None
    cached_tokens: int | None = None


class TrtllmEngine:
    """The ``Engine`` protocol over ``tensorrt_llm.LLM``. Not thread-safe: one caller drives it,
    as the worker does. ``close`` shuts TensorRT-LLM down."""

    def __init__(self, config: TrtllmEngineConfig, opener: LlmOpener = open_trtllm) -> None:
        self._config = config
        self._eos_token_id = (
            config.eos_token_id
            if config.eos_token_id is not None
            else HfTokenizer(config.model_dir).eos_token_id
        )
        self._max_seq_len = config.max_seq_len or max_positions(config.model_dir)
        self.max_num_seqs = config.max_num_seqs
        # Only the caller's thread touches these.
        self._requests: dict[str, _Request] = {}
        self._linger_until = 0.0
        self._held_failure: Failed | None = None
        self._session = LlmSession(lambda: opener(config, self._max_seq_len), config.kv_events)
        try:
            self.block_size, self.kv_blocks_total = self._kv_capacity()
        except BaseException:
            self.close()
            raise
        self.max_model_len = min(self._max_seq_len, self.kv_blocks_total * self.block_size)
        # KV lives on TensorRT-LLM's own executor, with no export of Laneway's; its steps are
        # real time spent there.
        self.capabilities = EngineCapabilities(
            kv_handoff=False, kv_events=self._session.kv_events, modelled_time=False
        )
        self._translator = KvEventTranslator(self.block_size)

    # -- the Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        request_id = request.request_id
        prompt = checked_prompt(request, self._requests, self._max_seq_len, "context")
        # TensorRT-LLM has guided decoding of its own; no adapter of it is built.
        refuse_unsupported(request, "trtllm")
        positions = len(prompt) + request.sampling.max_tokens
        # The KV of every token but the last sampled one must fit at once.
        needed_blocks = -(-(positions - 1) // self.block_size)
        if needed_blocks > self.kv_blocks_total:
            raise ValueError(
                f"request {request_id} needs {needed_blocks} KV blocks, "
                f"the engine has {self.kv_blocks_total}"
            )
        params = self._session.sampling_params(
            **sampling_kwargs(request.sampling, self._eos_token_id, request_id)
        )
        self._requests[request_id] = _Request(prompt_len=len(prompt))
        self._session.submit(request_id, prompt, params)

    def abort(self, request_id: str) -> bool:
        if self._requests.pop(request_id, None) is None:
            return False
        self._session.abort(request_id)
        self._note_idle()
        return True

    def step(self) -> StepResult:
        started = time.perf_counter()
        per_request: dict[str, _StepOutput] = {}
        kv_changes: list[KvChange] = []
        prefill_tokens = 0
        for update in self._take_updates():
            if isinstance(update, KvEvent):
                kv_changes.extend(self._translator.translate(update.event))
            elif isinstance(update, Tokens):
                prefill_tokens += self._collect(update, per_request)
        outputs = []
        for request_id, out in per_request.items():
            outputs.append(
                RequestOutput(
                    request_id,
                    tuple(out.token_ids),
                    out.finished,
                    out.finish_reason,
                    out.cached_tokens,
                )
            )
            if out.finished:
                del self._requests[request_id]
        if outputs:
            self._note_idle()
        return StepResult(
            outputs=outputs,
            kv_changes=kv_changes,
            duration_s=time.perf_counter() - started,
            prefill_tokens=prefill_tokens,
        )

    def has_work(self) -> bool:
        return (
            bool(self._requests)
            or time.monotonic() < self._linger_until
            or self._held_failure is not None
            or not self._session.updates.empty()
        )

    def load(self) -> EngineLoad:
        """Counts from the adapter's own bookkeeping: a request waits until its first token
        arrives, and a running one holds the blocks of all its tokens. Shared prefixes count
        once per sequence, so ``kv_blocks_used`` overstates what TensorRT-LLM holds."""
        waiting = [r for r in self._requests.values() if not r.started]
        used = sum(
            -(-(r.prompt_len + r.generated) // self.block_size)
            for r in self._requests.values()
            if r.started
        )
        return EngineLoad(
            running=len(self._requests) - len(waiting),
            waiting=len(waiting),
            waiting_prefill_tokens=sum(r.prompt_len for r in waiting),
            kv_blocks_used=min(used, self.kv_blocks_total),
            kv_blocks_total=self.kv_blocks_total,
        )

    def close(self) -> None:
        """Abandon running requests, shut TensorRT-LLM down and stop the adapter's thread."""
        if self._session.closed:
            return
        self._requests.clear()
        self._session.close()

    def __enter__(self) -> TrtllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- folding the session's updates ------------------------------------------------------

    def _kv_capacity(self) -> tuple[int, int]:
        """Block size and number of blocks of the KV pool TensorRT-LLM actually made."""
        reported = self._session.kv_capacity()
        if reported is not None:
            return reported
        if self._config.kv_cache_max_tokens is None:
            raise ValueError(
                "this TensorRT-LLM does not report its KV cache size; set kv_cache_max_tokens"
            )
        return self._config.block_size, self._config.kv_cache_max_tokens // self._config.block_size

    def _take_updates(self) -> list[Update]:
        """Everything ready, waiting ``poll_wait_s`` if nothing is. A failure is raised: at
        once if nothing precedes it, else at the next step, so that the updates taken before
        it are not lost."""
        if self._held_failure is not None:
            failure, self._held_failure = self._held_failure, None
            self._raise(failure)
        updates: list[Update] = []
        pending = self._session.updates
        wait: float | None = self._config.poll_wait_s
        while True:
            try:
                update = pending.get(timeout=wait) if wait else pending.get_nowait()
            except queue.Empty:
                return updates
            wait = None
            if not isinstance(update, Failed):
                updates.append(update)
            elif updates:
                self._held_failure = update
                return updates
            else:
                self._raise(update)

    def _raise(self, failure: Failed) -> None:
        if failure.request_id is None:
            raise TrtllmError(failure.message)
        # A request aborted meanwhile has nobody left to tell.
        if self._requests.pop(failure.request_id, None) is not None:
            self._note_idle()
            raise TrtllmError(failure.message, failure.request_id)

    def _collect(self, update: Tokens, per_request: dict[str, _StepOutput]) -> int:
        """Fold one streamed update into this step's outputs; returns the prompt tokens it
        shows were computed rather than found in the cache."""
        state = self._requests.get(update.request_id)
        # Aborted requests are gone; an update with neither tokens nor an end says nothing
        # (and would count as the first token for the worker's TTFT).
        if state is None or not (update.token_ids or update.finished):
            return 0
        out = per_request.setdefault(update.request_id, _StepOutput([]))
        out.token_ids.extend(update.token_ids)
        state.generated += len(update.token_ids)
        computed = 0
        if not state.started:
            state.started = True
            out.cached_tokens = update.cached_tokens
            computed = max(0, state.prompt_len - update.cached_tokens)
        if update.finished:
            out.finished = True
            out.finish_reason = "length" if update.finish_reason == "length" else "stop"
        return computed

    def _note_idle(self) -> None:
        if not self._requests:
            self._linger_until = time.monotonic() + self._config.linger_s
