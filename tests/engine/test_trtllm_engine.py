"""The TensorRT-LLM adapter.

Without a GPU, the adapter runs over a stand-in for ``tensorrt_llm.LLM`` that streams like the
real one (``tests/engine/trtllm_standin.py``), which checks the threading, step folding, aborts,
failures and KV event translation. The end-to-end test needs ``tensorrt_llm``, a CUDA device and
a model directory in ``LANEWAY_TRTLLM_MODEL``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from schemas.block_hash import chain_block_hashes, hash_block
from schemas.events import SamplingParams
from services.engine.protocol import (
    BlocksRemoved,
    BlocksStored,
    EngineRequest,
    StepResult,
)
from services.engine.trtllm_engine import (
    KvEventTranslator,
    TrtllmEngine,
    TrtllmEngineConfig,
    TrtllmError,
    sampling_kwargs,
)
from tests.engine._sim_support import outputs_by_request
from tests.engine.trtllm_standin import BLOCK, FakeLlm, removed_event, standin_engine, stored_event

# -- KV event translation ------------------------------------------------------------------


def test_stored_blocks_are_rehashed_with_laneways_chain() -> None:
    translator = KvEventTranslator(BLOCK)
    prompt = list(range(10, 22))
    expected = chain_block_hashes(prompt, BLOCK)
    first = translator.translate(stored_event(None, [(101, prompt[0:4]), (102, prompt[4:8])]))
    assert first == [BlocksStored(expected[:2], None)]
    # A child event names its parent by TensorRT-LLM's hash.
    child = translator.translate(stored_event(102, [(103, prompt[8:12])]))
    assert child == [BlocksStored(expected[2:], expected[1])]
    assert translator.translate(removed_event([103, 102])) == [
        BlocksRemoved((expected[2], expected[1]))
    ]
    # Removed blocks are forgotten: their removal, or a child of theirs, means nothing now.
    assert translator.translate(removed_event([102])) == []
    assert translator.translate(stored_event(102, [(104, [1, 2, 3, 4])])) == []


def test_partial_blocks_end_a_stored_run_and_are_never_announced() -> None:
    translator = KvEventTranslator(BLOCK)
    changes = translator.translate(
        stored_event(None, [(1, [5, 6, 7, 8]), (2, [9, 10]), (3, [11, 12, 13, 14])])
    )
    assert changes == [BlocksStored((hash_block(0, [5, 6, 7, 8]),), None)]
    assert translator.translate(stored_event(None, [(2, [9, 10])])) == []
    assert translator.translate(removed_event([2])) == []


def test_other_event_kinds_change_nothing() -> None:
    translator = KvEventTranslator(BLOCK)
    created = {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}}
    updated = {"event_id": 1, "data": {"type": "updated", "block_hash": 7}}
    assert translator.translate(created) == translator.translate(updated) == []


# -- sampling ------------------------------------------------------------------------------


def test_sampling_maps_greedy_to_top_k_one_and_seeds_from_the_request_id() -> None:
    greedy = sampling_kwargs(
        SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(9,)), 2, "r1"
    )
    assert greedy["top_k"] == 1 and "temperature" not in greedy
    assert greedy["end_id"] == 2 and greedy["stop_token_ids"] == [9]
    assert greedy["max_tokens"] == 5 and greedy["detokenize"] is False
    assert greedy["seed"] == sampling_kwargs(SamplingParams(max_tokens=5), 2, "r1")["seed"]
    assert greedy["seed"] != sampling_kwargs(SamplingParams(max_tokens=5), 2, "r2")["seed"]
    sampled = sampling_kwargs(
        SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True), 2, "r"
    )
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 3)
    assert sampled["ignore_eos"] is True and "top_k" not in sampled
    assert sampled["stop_token_ids"] is None


# -- the adapter over a stand-in LLM -------------------------------------------------------


def _engine(tmp_path: Path, llm: FakeLlm, **config: Any) -> tuple[TrtllmEngine, Callable[[], None]]:
    engine = standin_engine(tmp_path, llm, **config)
    return engine, engine.close


def _request(request_id: str, prompt: list[int], max_tokens: int = 5, **kw: Any) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return EngineRequest(request_id, tuple(prompt), sampling)


def _run(
    engine: TrtllmEngine, until: Callable[[list[StepResult]], bool], timeout_s: float = 10.0
) -> list[StepResult]:
    results: list[StepResult] = []
    deadline = time.monotonic() + timeout_s
    while not until(results):
        assert time.monotonic() < deadline, "the adapter did not get there"
        results.append(engine.step())
    return results


def _finished(*request_ids: str) -> Callable[[list[StepResult]], bool]:
    def check(results: list[StepResult]) -> bool:
        done = {o.request_id for r in results for o in r.outputs if o.finished}
        return done >= set(request_ids)

    return check


def test_generates_folds_outputs_and_reports_kv_events(tmp_path: Path) -> None:
    llm = FakeLlm()
    llm.cached_tokens = 4
    engine, close = _engine(tmp_path, llm)
    try:
        assert (engine.block_size, engine.kv_blocks_total) == (BLOCK, 64)
        assert engine.capabilities.kv_events
        prompt_a, prompt_b = list(range(10, 20)), list(range(40, 46))
        engine.add_request(_request("a", prompt_a))
        engine.add_request(_request("b", prompt_b, max_tokens=8, stop_token_ids=(49,)))
        load = engine.load()
        assert (load.running, load.waiting, load.waiting_prefill_tokens) == (0, 2, 16)
        results = _run(engine, _finished("a", "b"))
        outputs = outputs_by_request(results)
        a = [t for o in outputs["a"] for t in o.new_token_ids]
        b = [t for o in outputs["b"] for t in o.new_token_ids]
        assert a == [20, 21, 22, 23, 24] and b == [46, 47, 48, 49]
        assert (outputs["a"][-1].finish_reason, outputs["b"][-1].finish_reason) == (
            "length",
            "stop",
        )
        # The cache hit is reported once, with the first tokens, and never counted as prefill.
        assert outputs["a"][0].cached_tokens == 4
        assert all(o.cached_tokens is None for o in outputs["a"][1:])
        assert sum(r.prefill_tokens for r in results) == (10 - 4) + (6 - 4)
        assert all(o.new_token_ids for outs in outputs.values() for o in outs)
        assert all(r.duration_s > 0 for r in results)
        assert llm.submitted[0][1]["top_k"] == 1 and llm.submitted[1][1]["stop_token_ids"] == [49]
        # The stored events arrive after the requests end; steps go on while they are queued.
        stored: set[int] = set()
        deadline = time.monotonic() + 10
        want = set(
            chain_block_hashes(prompt_a + a, BLOCK) + chain_block_hashes(prompt_b + b, BLOCK)
        )
        while not stored >= want:
            assert time.monotonic() < deadline, "no KV events"
            for change in engine.step().kv_changes:
                assert isinstance(change, BlocksStored)
                stored.update(change.block_hashes)
        assert stored == want  # the trailing partial blocks are left out
        assert engine.load().running == 0
    finally:
        close()
    assert llm.shut_down


def test_abort_stops_the_request_and_drops_its_later_output(tmp_path: Path) -> None:
    llm = FakeLlm()
    llm.iteration_s = 0.005
    engine, close = _engine(tmp_path, llm)
    try:
        engine.add_request(_request("long", [5, 6, 7], max_tokens=50))
        _run(engine, lambda results: any(r.outputs for r in results))
        assert engine.load().running == 1
        assert engine.abort("long") and not engine.abort("long")
        assert not engine.has_work()  # linger_s is 0
        later = [engine.step() for _ in range(20)]
        assert not any(r.outputs for r in later)
        assert llm.results[0].aborted
        # Aborted before the loop even submitted it: never reaches TensorRT-LLM's output.
        engine.add_request(_request("gone", [8, 9]))
        assert engine.abort("gone")
        assert not any(engine.step().outputs for _ in range(10))
    finally:
        close()


def test_a_refused_request_fails_loudly_without_losing_other_output(tmp_path: Path) -> None:
    llm = FakeLlm()
    llm.refuse = {99}
    engine, close = _engine(tmp_path, llm)
    try:
        engine.add_request(_request("ok", [1, 2, 3], max_tokens=1))
        _run(engine, lambda results: any(r.outputs for r in results))
        engine.add_request(_request("bad", [99, 1]))
        with pytest.raises(TrtllmError, match="refused") as failure:
            _run(engine, lambda results: False)
        assert failure.value.request_id == "bad"
        assert engine.load().waiting == 0
        engine.add_request(_request("after", [4, 5], max_tokens=2))
        assert outputs_by_request(_run(engine, _finished("after")))["after"][-1].finished
    finally:
        close()


def test_a_failure_while_streaming_is_raised(tmp_path: Path) -> None:
    llm = FakeLlm()
    llm.fail_streaming = True
    engine, close = _engine(tmp_path, llm)
    try:
        engine.add_request(_request("doomed", [1, 2]))
        with pytest.raises(TrtllmError, match="illegal memory access"):
            _run(engine, lambda results: False)
        assert not engine.has_work()
    finally:
        close()


def test_requests_are_checked_before_they_are_submitted(tmp_path: Path) -> None:
    llm = FakeLlm()
    engine, close = _engine(tmp_path, llm, kv_events=False)
    try:
        assert not engine.capabilities.kv_events
        with pytest.raises(ValueError, match="positions"):
            engine.add_request(_request("huge", list(range(60)), max_tokens=10))
        with pytest.raises(ValueError, match="empty"):
            engine.add_request(_request("empty", []))
        engine.add_request(_request("x", [1, 2, 3, 4, 5], max_tokens=1))
        with pytest.raises(ValueError, match="already"):
            engine.add_request(_request("x", [1]))
        results = _run(engine, _finished("x"))
        assert not any(r.kv_changes for r in results)
        assert llm.submitted == [([1, 2, 3, 4, 5], llm.submitted[0][1])]
    finally:
        close()


# -- the real thing ------------------------------------------------------------------------


@pytest.mark.gpu
def test_trtllm_generates_end_to_end() -> None:
    pytest.importorskip("tensorrt_llm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = os.environ.get("LANEWAY_TRTLLM_MODEL")
    if not model:
        pytest.skip("set LANEWAY_TRTLLM_MODEL to a Hugging Face model directory")
    from services.common.hf_tokenizer import HfTokenizer

    tokenizer = HfTokenizer(Path(model))
    prompt = tokenizer.encode("The ferry crossed the river at dawn, and the ferryman said " * 4)
    with TrtllmEngine(TrtllmEngineConfig(model_dir=Path(model))) as engine:
        for request_id in ("first", "second"):
            engine.add_request(_request(request_id, prompt, max_tokens=16, ignore_eos=True))
            results = _run(engine, _finished(request_id), timeout_s=300)
            outputs = outputs_by_request(results)[request_id]
            tokens = [t for o in outputs for t in o.new_token_ids]
            assert len(tokens) == 16 and outputs[-1].finish_reason == "length"
            assert tokenizer.decode(tokens)
        # The second request found the first one's prompt blocks in the cache.
        assert (outputs[0].cached_tokens or 0) >= engine.block_size
        if engine.capabilities.kv_events:
            stored: set[int] = set()
            deadline = time.monotonic() + 30
            want = set(chain_block_hashes(prompt, engine.block_size))
            while not stored >= want and time.monotonic() < deadline:
                for change in engine.step().kv_changes:
                    if isinstance(change, BlocksStored):
                        stored.update(change.block_hashes)
            assert stored >= want
