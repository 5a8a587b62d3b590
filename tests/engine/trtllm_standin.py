"""A stand-in for ``tensorrt_llm.LLM`` that streams like the real one: an async-iterable result
per request whose token ids accumulate, and one async KV event stream for the LLM's lifetime that
ends at its first timeout until re-armed. It caches as TensorRT-LLM does: every full block of a
finished sequence once, the partial last block too (with a hash of its own), and a new request's
cached tokens are its leading full blocks found there, its last prompt token excepted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from services.engine.trtllm_engine import TrtllmEngine, TrtllmEngineConfig

BLOCK = 4
NUM_BLOCKS = 64


def stored_event(parent: int | None, blocks: list[tuple[int, list[int]]]) -> dict[str, Any]:
    """A "stored" event as ``get_kv_cache_events_async`` yields it."""
    return {
        "event_id": 0,
        "data": {
            "type": "stored",
            "parent_hash": parent,
            "blocks": [
                {
                    "block_hash": h,
                    "tokens": [
                        {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids
                    ],
                }
                for h, ids in blocks
            ],
        },
    }


def removed_event(hashes: list[int]) -> dict[str, Any]:
    return {"event_id": 0, "data": {"type": "removed", "block_hashes": hashes}}


class FakeResult:
    """Streams like ``GenerationResult``: one output per iteration, token ids accumulating."""

    def __init__(self, llm: FakeLlm, prompt: list[int], params: dict[str, Any]) -> None:
        self._llm = llm
        self._prompt = prompt
        self._params = params
        self.outputs = [SimpleNamespace(token_ids=[], finish_reason=None)]
        self.finished = False
        self.cached_tokens = llm.cached_prompt_tokens(prompt)
        self.aborted = False

    def __aiter__(self) -> FakeResult:
        return self

    async def __anext__(self) -> FakeResult:
        if self.finished:
            raise StopAsyncIteration
        await asyncio.sleep(self._llm.iteration_s)
        completion = self.outputs[0]
        if self.aborted:
            self.finished, completion.finish_reason = True, "cancelled"
            return self
        if self._llm.fail_streaming:
            raise RuntimeError("CUDA error: an illegal memory access")
        token = self._prompt[-1] + len(completion.token_ids) + 1
        completion.token_ids.append(token)
        if token in (self._params["stop_token_ids"] or ()):
            self.finished, completion.finish_reason = True, "stop"
        elif len(completion.token_ids) == self._params["max_tokens"]:
            self.finished, completion.finish_reason = True, "length"
        if self.finished:
            self._llm.finish(self._prompt + completion.token_ids)
        return self

    def abort(self) -> None:
        self.aborted = True


class FakeEventStream:
    """Like TensorRT-LLM's ``IterationResult``: ends at the first timeout, until re-armed."""

    def __init__(self, llm: FakeLlm) -> None:
        self._llm = llm
        self._done = False

    def mark_undone(self) -> None:
        self._done = False

    def __aiter__(self) -> FakeEventStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done or not self._llm.events:
            self._done = True
            raise StopAsyncIteration
        return self._llm.events.pop(0)


class FakeLlm:
    def __init__(self) -> None:
        self.submitted: list[tuple[list[int], dict[str, Any]]] = []
        self.results: list[FakeResult] = []
        self.events: list[dict[str, Any]] = []
        # None: what the cache holds; a number: every request reports it.
        self.cached_tokens: int | None = None
        self.iteration_s = 0.0
        self.refuse: set[int] = set()
        self.fail_streaming = False
        self.shut_down = False
        self._next_hash = 1000
        # The tokens up to the end of each cached full block -> TensorRT-LLM's hash of it.
        self._cached: dict[tuple[int, ...], int] = {}
        # One stream for the LLM's lifetime, as TensorRT-LLM keeps one.
        self._events = FakeEventStream(self)

    def generate_async(
        self, inputs: dict[str, list[int]], sampling_params: dict[str, Any], streaming: bool
    ) -> FakeResult:
        assert streaming
        prompt = inputs["prompt_token_ids"]
        if prompt[0] in self.refuse:
            raise ValueError("prompt too long")
        self.submitted.append((prompt, sampling_params))
        result = FakeResult(self, prompt, sampling_params)
        self.results.append(result)
        return result

    def cached_prompt_tokens(self, prompt: list[int]) -> int:
        if self.cached_tokens is not None:
            return self.cached_tokens
        blocks = 0
        while (blocks + 1) * BLOCK < len(prompt) and tuple(prompt[: (blocks + 1) * BLOCK]) in (
            self._cached
        ):
            blocks += 1
        return blocks * BLOCK

    def finish(self, sequence: list[int]) -> None:
        """Store the sequence's blocks not cached yet, the last one partial, as TensorRT-LLM
        reports them: one event whose parent is the last block already cached."""
        parent: int | None = None
        blocks: list[tuple[int, list[int]]] = []
        for start in range(0, len(sequence), BLOCK):
            chunk = sequence[start : start + BLOCK]
            key = tuple(sequence[: start + BLOCK])
            full = len(chunk) == BLOCK
            if full and not blocks and key in self._cached:
                parent = self._cached[key]
                continue
            if full:
                self._cached[key] = self._next_hash
            blocks.append((self._next_hash, chunk))
            self._next_hash += 1
        if blocks:
            self.events.append(stored_event(parent, blocks))

    def get_kv_cache_events_async(self, timeout: float) -> FakeEventStream:
        return self._events

    def get_kv_cache_capacity(self) -> dict[str, int]:
        return {"maxNumBlocks": NUM_BLOCKS, "tokensPerBlock": BLOCK, "maxNumTokens": 64 * BLOCK}

    def shutdown(self) -> None:
        self.shut_down = True


def standin_engine(model_dir: Path, llm: FakeLlm, **config: Any) -> TrtllmEngine:
    """A ``TrtllmEngine`` over ``llm``; ``config`` overrides ``TrtllmEngineConfig`` fields."""
    settings = TrtllmEngineConfig(
        **{"model_dir": model_dir, "eos_token_id": 2, "max_seq_len": 64, "linger_s": 0.0, **config}
    )
    return TrtllmEngine(settings, opener=lambda _config, _max_seq_len: (llm, dict))
