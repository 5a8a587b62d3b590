"""The thread that owns every call into TensorRT-LLM's LLM API.

TensorRT-LLM schedules and runs its own iterations on its own executor and streams results to
asyncio. ``LlmSession`` runs a private asyncio loop on a thread of its own: requests are submitted
and streamed there (``generate_async(..., streaming=True)``), KV cache events are pulled there,
and both land, in order, in one thread-safe queue of updates for the engine's caller to drain.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long one pull of KV events waits for the next event, and the pause after an empty pull.
KV_EVENT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Tokens:
    """One streamed output of a request: the tokens new since the last, and whether it ended."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class KvEvent:
    event: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    """TensorRT-LLM failed a request (``request_id`` set) or its KV event stream."""

    request_id: str | None
    message: str


Update = Tokens | KvEvent | Failed


class LlmSession:
    """An ``LLM`` opened by ``open_llm`` on the session's thread, so that whatever TensorRT-LLM
    binds to the current event loop is bound to the one that will consume it. ``close`` shuts
    it down."""

    def __init__(
        self, open_llm: Callable[[], tuple[Any, Callable[..., Any]]], kv_events: bool
    ) -> None:
        self.updates: queue.SimpleQueue[Update] = queue.SimpleQueue()
        # Only the session's loop touches these.
        self._handles: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._kv_pump_started = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="trtllm-adapter", daemon=True
        )
        self._thread.start()
        try:
            self.llm, self.sampling_params = self.call(open_llm)
        except BaseException:
            self._stop_loop()
            raise
        self.kv_events = kv_events and hasattr(self.llm, "get_kv_cache_events_async")

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the session's loop and wait for it."""

        async def invoke() -> _T:
            return fn()

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result()

    def kv_capacity(self) -> tuple[int, int] | None:
        """Block size and number of blocks of the KV pool TensorRT-LLM made, if it says."""
        report = getattr(self.llm, "get_kv_cache_capacity", None)
        if report is None:
            return None
        capacity = self.call(report)
        return int(capacity["tokensPerBlock"]), int(capacity["maxNumBlocks"])

    def submit(self, request_id: str, prompt: list[int], params: Any) -> None:
        self._loop.call_soon_threadsafe(self._submit, request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        # Queued behind the request's own submission, so the loop has a handle to abort unless
        # the request already ended there.
        self._loop.call_soon_threadsafe(self._abort_on_loop, request_id)

    def close(self) -> None:
        """Abandon running requests, shut TensorRT-LLM down and stop the session's thread."""
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- on the session's loop ---------------------------------------------------------------

    def _submit(self, request_id: str, prompt: list[int], params: Any) -> None:
        try:
            result = self.llm.generate_async(
                {"prompt_token_ids": prompt}, sampling_params=params, streaming=True
            )
        except Exception as exc:
            self.updates.put(Failed(request_id, f"TensorRT-LLM refused the request: {exc}"))
            return
        self._handles[request_id] = result
        self._spawn(self._stream(request_id, result))
        # TensorRT-LLM creates its event stream with the first request, not before.
        if not self._kv_pump_started and self.kv_events:
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
                self.updates.put(
                    Tokens(
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
            self.updates.put(Failed(request_id, f"TensorRT-LLM failed the request: {exc}"))
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
                events = self.llm.get_kv_cache_events_async(timeout=KV_EVENT_POLL_S)
                # The stream ends at its first timeout and stays ended until the next
                # submission re-arms it; re-arming here keeps the events of a long request, or
                # of the last one before a pause, from waiting for someone else's request.
                rearm = getattr(events, "mark_undone", None)
                if rearm is not None:
                    rearm()
                received = False
                async for event in events:
                    received = True
                    self.updates.put(KvEvent(event))
                if not received:
                    await asyncio.sleep(KV_EVENT_POLL_S)
        except Exception as exc:
            log.exception("reading TensorRT-LLM's KV events failed")
            self.updates.put(Failed(None, f"reading TensorRT-LLM's KV events failed: {exc}"))

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.llm.shutdown()
