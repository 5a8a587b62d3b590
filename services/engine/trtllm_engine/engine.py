"""``TrtllmEngine``: TensorRT-LLM's LLM API behind the step-driven ``Engine`` protocol.

TensorRT-LLM schedules and runs its own iterations on its own executor; Laneway's protocol wants
a synchronous ``step`` that reports what happened. The adapter bridges the two with a private
asyncio loop on a thread of its own that owns every call into the LLM API: requests are submitted
and streamed there (``generate_async(..., streaming=True)``), KV cache events are pulled there,
and both land in one thread-safe queue. ``step`` drains that queue without blocking (waiting a
moment only when it is empty) and reports the wall time it took.

``tensorrt_llm`` is imported only when an engine is opened, so this module imports anywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from schemas.events import SamplingParams
from services.common.hf_tokenizer import HfTokenizer
from services.engine.protocol import (
    EngineLoad,
    EngineRequest,
    KvChange,
    RequestOutput,
    StepResult,
)
from services.engine.trtllm_engine.kv_events import KvEventTranslator

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long one pull of KV events waits for the next event, and the pause after an empty pull.
KV_EVENT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class TrtllmEngineConfig:
    model_dir: Path
    # Tokens per KV block (TensorRT-LLM's tokens_per_block); the engine's own report wins.
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Longest prompt plus completion; None: the model's max_position_embeddings.
    max_seq_len: int | None = None
    # KV cache size in tokens; None: ``free_gpu_memory_fraction`` of the memory left after the
    # weights. TensorRT-LLM versions that cannot report the pool's size need it set.
    kv_cache_max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    kv_events: bool = True
    event_buffer_max_size: int = 16384
    # None: the model directory's end-of-sequence token.
    eos_token_id: int | None = None
    # How long a step waits for output when none is ready: short enough not to stall the
    # worker's event loop, long enough not to spin.
    poll_wait_s: float = 0.002
    # How long steps go on after the last request ends, to collect its trailing KV events.
    linger_s: float = 1.0


class TrtllmError(RuntimeError):
    """TensorRT-LLM failed a request (``request_id`` set) or the engine itself."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


LlmOpener = Callable[[TrtllmEngineConfig, int], tuple[Any, Callable[..., Any]]]


def open_trtllm(config: TrtllmEngineConfig, max_seq_len: int) -> tuple[Any, Callable[..., Any]]:
    """Start TensorRT-LLM on ``config.model_dir``; returns the ``LLM`` and its
    ``SamplingParams`` class."""
    from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams as TrtSamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    kv_cache_config = KvCacheConfig(
        enable_block_reuse=True,
        tokens_per_block=config.block_size,
        max_tokens=config.kv_cache_max_tokens,
        free_gpu_memory_fraction=config.free_gpu_memory_fraction,
        event_buffer_max_size=config.event_buffer_max_size if config.kv_events else 0,
    )
    llm = LLM(
        model=str(config.model_dir),
        # Laneway tokenizes at ingress and detokenizes in the worker.
        skip_tokenizer_init=True,
        kv_cache_config=kv_cache_config,
        max_batch_size=config.max_num_seqs,
        max_num_tokens=config.max_num_batched_tokens,
        max_seq_len=max_seq_len,
        enable_chunked_prefill=True,
    )
    return llm, TrtSamplingParams


def sampling_kwargs(
    sampling: SamplingParams, eos_token_id: int, request_id: str
) -> dict[str, object]:
    """TensorRT-LLM ``SamplingParams`` arguments for Laneway's sampling settings. Stop strings
    are left out: the worker cuts them from the text and aborts the request."""
    seed = sampling.seed
    if seed is None:
        # Without a seed every request would sample with TensorRT-LLM's default seed 0;
        # crc32, not hash(), so that a request id always means the same seed.
        seed = zlib.crc32(request_id.encode())
    kwargs: dict[str, object] = {
        "max_tokens": sampling.max_tokens,
        "end_id": eos_token_id,
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "seed": seed,
        "detokenize": False,
    }
    if sampling.temperature == 0.0:
        # TensorRT-LLM decodes greedily when sampling is restricted to the top token.
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        kwargs["top_p"] = sampling.top_p
    return kwargs


@dataclass(frozen=True, slots=True)
class _Tokens:
    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class _KvEvent:
    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Failed:
    request_id: str | None
    message: str


_Update = _Tokens | _KvEvent | _Failed


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
        self._max_seq_len = config.max_seq_len or _max_positions(config.model_dir)
        self.max_num_seqs = config.max_num_seqs
        self._updates: queue.SimpleQueue[_Update] = queue.SimpleQueue()
        # Only the caller's thread touches these.
        self._requests: dict[str, _Request] = {}
        self._linger_until = 0.0
        self._held_failure: _Failed | None = None
        # Only the adapter's loop touches these.
        self._handles: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._kv_pump_started = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="trtllm-adapter", daemon=True
        )
        self._thread.start()
        try:
            # Opened on the adapter's loop, so that whatever TensorRT-LLM binds to the current
            # event loop is bound to the one that will consume it.
            self._llm, self._sampling_params = self._call(lambda: opener(config, self._max_seq_len))
        except BaseException:
            self._stop_loop()
            raise
        try:
            self.block_size, self.kv_blocks_total = self._kv_capacity()
        except BaseException:
            self.close()
            raise
        self._translator = KvEventTranslator(self.block_size)

    @property
    def publishes_kv_events(self) -> bool:
        """Whether ``step`` reports KV changes; register the worker with ``kv_events`` set to
        this, so that the indexer predicts the cache of an engine that does not."""
        return self._config.kv_events and hasattr(self._llm, "get_kv_cache_events_async")

    # -- the Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        request_id = request.request_id
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already in the engine")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id} has an empty prompt")
        if len(prompt) + request.sampling.max_tokens > self._max_seq_len:
            raise ValueError(
                f"request {request_id} needs {len(prompt)} + {request.sampling.max_tokens} "
                f"positions, the engine has {self._max_seq_len}"
            )
        params = self._sampling_params(
            **sampling_kwargs(request.sampling, self._eos_token_id, request_id)
        )
        self._requests[request_id] = _Request(prompt_len=len(prompt))
        self._loop.call_soon_threadsafe(self._submit, request_id, prompt, params)

    def abort(self, request_id: str) -> bool:
        if self._requests.pop(request_id, None) is None:
            return False
        # Queued behind the request's own submission, so the loop has a handle to abort unless
        # the request already ended there.
        self._loop.call_soon_threadsafe(self._abort_on_loop, request_id)
        self._note_idle()
        return True

    def step(self) -> StepResult:
        started = time.perf_counter()
        per_request: dict[str, _StepOutput] = {}
        kv_changes: list[KvChange] = []
        prefill_tokens = 0
        for update in self._take_updates():
            if isinstance(update, _KvEvent):
                kv_changes.extend(self._translator.translate(update.event))
            elif isinstance(update, _Tokens):
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
            or not self._updates.empty()
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
        if self._loop.is_closed():
            return
        self._requests.clear()
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._stop_loop()

    def __enter__(self) -> TrtllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the caller's side -----------------------------------------------------------------

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the adapter's loop and wait for it."""

        async def invoke() -> _T:
            return fn()

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result()

    def _kv_capacity(self) -> tuple[int, int]:
        """Block size and number of blocks of the KV pool TensorRT-LLM actually made."""
        report = getattr(self._llm, "get_kv_cache_capacity", None)
        if report is not None:
            capacity = self._call(report)
            return int(capacity["tokensPerBlock"]), int(capacity["maxNumBlocks"])
        if self._config.kv_cache_max_tokens is None:
            raise ValueError(
                "this TensorRT-LLM does not report its KV cache size; set kv_cache_max_tokens"
            )
        return self._config.block_size, self._config.kv_cache_max_tokens // self._config.block_size

    def _take_updates(self) -> list[_Update]:
        """Everything ready, waiting ``poll_wait_s`` if nothing is. A failure is raised: at
        once if nothing precedes it, else at the next step, so that the updates taken before
        it are not lost."""
        if self._held_failure is not None:
            failure, self._held_failure = self._held_failure, None
            self._raise(failure)
        updates: list[_Update] = []
        wait: float | None = self._config.poll_wait_s
        while True:
            try:
                update = self._updates.get(timeout=wait) if wait else self._updates.get_nowait()
            except queue.Empty:
                return updates
            wait = None
            if not isinstance(update, _Failed):
                updates.append(update)
            elif updates:
                self._held_failure = update
                return updates
            else:
                self._raise(update)

    def _raise(self, failure: _Failed) -> None:
        if failure.request_id is None:
            raise TrtllmError(failure.message)
        # A request aborted meanwhile has nobody left to tell.
        if self._requests.pop(failure.request_id, None) is not None:
            self._note_idle()
            raise TrtllmError(failure.message, failure.request_id)

    def _collect(self, update: _Tokens, per_request: dict[str, _StepOutput]) -> int:
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

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- the adapter's loop ----------------------------------------------------------------

    def _submit(self, request_id: str, prompt: list[int], params: Any) -> None:
        try:
            result = self._llm.generate_async(
                {"prompt_token_ids": prompt}, sampling_params=params, streaming=True
            )
        except Exception as exc:
            self._updates.put(_Failed(request_id, f"TensorRT-LLM refused the request: {exc}"))
            return
        self._handles[request_id] = result
        self._spawn(self._stream(request_id, result))
        # TensorRT-LLM creates its event stream with the first request, not before.
        if not self._kv_pump_started and self.publishes_kv_events:
            self._kv_pump_started = True
            self._spawn(self._pump_kv_events())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        # The loop keeps only weak references to its tasks.
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, request_id: str, result: Any) -> None:
        seen = 0
        try:
            async for output in result:
                completion = output.outputs[0]
                token_ids = completion.token_ids
                self._updates.put(
                    _Tokens(
                        request_id,
                        tuple(token_ids[seen:]),
                        bool(output.finished),
                        completion.finish_reason,
                        int(getattr(output, "cached_tokens", 0) or 0),
                    )
                )
                # The final output may drop a matched stop token from the ids already streamed.
                seen = max(seen, len(token_ids))
        except Exception as exc:
            self._updates.put(_Failed(request_id, f"TensorRT-LLM failed the request: {exc}"))
        finally:
            # The id may have been aborted and reused meanwhile; that handle is not ours.
            if self._handles.get(request_id) is result:
                del self._handles[request_id]

    def _abort_on_loop(self, request_id: str) -> None:
        handle = self._handles.get(request_id)
        if handle is not None:
            handle.abort()

    async def _pump_kv_events(self) -> None:
        try:
            while True:
                events = self._llm.get_kv_cache_events_async(timeout=KV_EVENT_POLL_S)
                # The stream ends at its first timeout and stays ended until the next
                # submission re-arms it; re-arming here keeps the events of a long request, or
                # of the last one before a pause, from waiting for someone else's request.
                rearm = getattr(events, "mark_undone", None)
                if rearm is not None:
                    rearm()
                received = False
                async for event in events:
                    received = True
                    self._updates.put(_KvEvent(event))
                if not received:
                    await asyncio.sleep(KV_EVENT_POLL_S)
        except Exception as exc:
            log.exception("reading TensorRT-LLM's KV events failed")
            self._updates.put(_Failed(None, f"reading TensorRT-LLM's KV events failed: {exc}"))

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._llm.shutdown()


def _max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config["max_position_embeddings"])
