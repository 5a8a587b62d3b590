"""The ``Engine`` protocol's promises, checked against every engine: sim, torch (a tiny random
checkpoint on the CPU), TensorRT-LLM (the adapter over its stand-in) and vLLM (its CPU build over
`laneway make-tiny-model`'s checkpoint). An engine that breaks a promise the worker or the indexer
relies on fails here, whichever engine it is. Each engine has 64 KV blocks; their size is the
engine's own (vLLM's CPU attention takes multiples of 32), and the prompts are made to fit it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.engine.continuation import continuation
from services.engine.protocol import (
    Engine,
    EngineCapabilities,
    EngineRequest,
    RequestOutput,
    StepResult,
    kv_portable,
    whole_prompt_handoff,
)
from services.engine.sim import SimConfig, SimEngine
from services.engine.torch_engine import TorchEngine, TorchEngineConfig
from tests.engine.torch_engine.tiny_checkpoint import write_tiny_checkpoint

from ._sim_support import fold, outputs_by_request, run_to_end
from .trtllm_standin import FakeLlm, standin_engine
from .vllm_pool import NUM_BLOCKS, VllmPool

BLOCK = 4  # the engines' but vLLM's
# Its engines come from a fixture the fixture asks for as it runs: marked by hand.
VLLM = pytest.mark.vllm
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 32

EngineFactory = Callable[[], Engine]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("contract-llama"))


@pytest.fixture(
    params=["sim", "torch", "trtllm", "trtllm-no-kv-events", pytest.param("vllm", marks=VLLM)]
)
def new_engine(
    request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path: Path
) -> Iterator[EngineFactory]:
    """Makes fresh engines of one kind, all of the same shape."""
    opened = []

    def make() -> Engine:
        if request.param == "vllm":
            pool: VllmPool = request.getfixturevalue("vllm_pool")
            return pool.fresh()
        if request.param == "sim":
            return SimEngine(
                SimConfig(BLOCK, NUM_BLOCKS, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, "fixed")
            )
        if request.param == "torch":
            config = TorchEngineConfig(BLOCK, NUM_BLOCKS, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
            return TorchEngine(tiny_checkpoint, config)
        llm = FakeLlm()
        # Slow enough that a long request is still running when the test aborts it.
        llm.iteration_s = 0.002
        trtllm = standin_engine(
            tmp_path,
            llm,
            max_seq_len=1024,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            # Long enough for trailing KV events to arrive (the adapter polls them every 50 ms).
            linger_s=0.2,
            kv_events=request.param == "trtllm",
        )
        opened.append(trtllm)
        return trtllm

    yield make
    for engine in opened:
        engine.close()


def make_request(request_id: str, prompt: list[int], max_tokens: int = 6) -> EngineRequest:
    # The tiny model's vocabulary is 300: every prompt token stays below it.
    assert all(3 <= t < 300 for t in prompt)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id, tuple(prompt), sampling)


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def folded(results: list[StepResult], view: set[int] | None = None) -> set[int]:
    """A KV event consumer's view of the cache after ``results``, each change checked."""
    view = set() if view is None else view
    for result in results:
        fold(result.kv_changes, view)
    return view


def leading(hashes: Sequence[int], view: set[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in view:
        n += 1
    return n


def run_one(engine: Engine, request_id: str, prompt: list[int]) -> list[StepResult]:
    engine.add_request(make_request(request_id, prompt))
    return run_to_end(engine)


def prompts(block: int) -> dict[str, list[int]]:
    return {
        "a": list(range(10, 11 + 3 * block)),  # 3 full blocks and a partial one
        "b": list(range(40, 40 + 2 * block)),  # exactly 2 blocks
        "c": [7, 8, 9],  # shorter than a block
    }


def test_every_request_ends_exactly_once_with_its_tokens_in_order(
    new_engine: EngineFactory,
) -> None:
    engine = new_engine()
    cases = prompts(engine.block_size)
    assert isinstance(engine.capabilities, EngineCapabilities)
    assert not engine.has_work()
    max_tokens = {"a": 6, "b": 9, "c": 1}
    for rid, prompt in cases.items():
        engine.add_request(make_request(rid, prompt, max_tokens[rid]))
    assert engine.has_work()
    results = run_to_end(engine)
    outputs = outputs_by_request(results)
    assert set(outputs) == set(cases)
    for rid, outs in outputs.items():
        # One finished output, the last: nothing for a request after its end.
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        assert outs[-1].finish_reason == "length"
        assert all(o.new_token_ids for o in outs), "an output without tokens"
        assert len(tokens_of(outs)) == max_tokens[rid]
        # Only the first output says what the cache held; a fresh engine held nothing.
        assert outs[0].cached_tokens == 0
        assert all(o.cached_tokens is None for o in outs[1:])
    assert all(r.duration_s >= 0 for r in results)
    assert sum(r.prefill_tokens for r in results) == sum(len(p) for p in cases.values())
    # Batched or alone, greedy decoding gives a request the same tokens in the same order.
    for rid, prompt in cases.items():
        alone = new_engine()
        alone.add_request(make_request(rid, prompt, max_tokens[rid]))
        assert tokens_of(outputs_by_request(run_to_end(alone))[rid]) == tokens_of(outputs[rid]), rid


def test_queue_and_kv_occupancy_are_reported(new_engine: EngineFactory) -> None:
    engine = new_engine()
    cases = prompts(engine.block_size)
    idle = engine.load()
    assert (idle.running, idle.waiting, idle.waiting_prefill_tokens, idle.kv_blocks_used) == (
        0,
        0,
        0,
        0,
    )
    assert idle.kv_blocks_total == engine.kv_blocks_total == NUM_BLOCKS
    assert engine.max_num_seqs == MAX_NUM_SEQS
    for rid, prompt in cases.items():
        engine.add_request(make_request(rid, prompt))
    queued = engine.load()
    assert queued.running + queued.waiting == len(cases)
    results: list[StepResult] = []
    while not any(o.finished for r in results for o in r.outputs):
        load = engine.load()
        assert load.running + load.waiting == len(cases)
        assert 0 <= load.kv_blocks_used <= NUM_BLOCKS
        results.append(engine.step())
    run_to_end(engine)
    done = engine.load()
    assert (done.running, done.waiting, done.waiting_prefill_tokens) == (0, 0, 0)


def test_an_aborted_request_stops_and_the_engine_serves_on(new_engine: EngineFactory) -> None:
    engine = new_engine()
    cases = prompts(engine.block_size)
    engine.add_request(make_request("long", list(range(20, 30)), max_tokens=200))
    engine.add_request(make_request("short", cases["b"], max_tokens=3))
    results: list[StepResult] = []
    while "long" not in outputs_by_request(results):
        results.append(engine.step())
    assert engine.abort("long")
    assert not engine.abort("long")
    assert not engine.abort("never-added")
    after = run_to_end(engine)
    assert "long" not in outputs_by_request(after)
    short = outputs_by_request(results + after)["short"]
    assert short[-1].finished and len(tokens_of(short)) == 3
    assert engine.load().running == engine.load().waiting == 0
    # The id is free again.
    engine.add_request(make_request("long", cases["c"], max_tokens=2))
    assert outputs_by_request(run_to_end(engine))["long"][-1].finished


def test_a_request_the_engine_can_never_serve_is_refused_and_changes_nothing(
    new_engine: EngineFactory,
) -> None:
    engine = new_engine()
    block, cases = engine.block_size, prompts(engine.block_size)
    # 75 blocks' worth of tokens; the pool has 64.
    huge = [3 + i % 290 for i in range(75 * block)]
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(make_request("huge", huge, max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(make_request("empty", []))
    assert not engine.has_work()
    engine.add_request(make_request("ok", cases["a"], max_tokens=2))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(make_request("ok", cases["b"]))
    outputs = outputs_by_request(run_to_end(engine))
    assert set(outputs) == {"ok"} and len(tokens_of(outputs["ok"])) == 2


def test_log_probabilities_come_with_each_token_or_the_request_is_refused(
    new_engine: EngineFactory,
) -> None:
    engine = new_engine()
    prompt = prompts(engine.block_size)["a"]
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
    request = EngineRequest("r", tuple(prompt), sampling)
    if not engine.capabilities.logprobs:
        with pytest.raises(ValueError, match="log probabilities"):
            engine.add_request(request)
        assert not engine.has_work()
        return
    engine.add_request(request)
    outputs = outputs_by_request(run_to_end(engine))["r"]
    for out in outputs:
        assert len(out.logprobs) == len(out.new_token_ids)
        for token_id, entry in zip(out.new_token_ids, out.logprobs, strict=True):
            ids = [t for t, _ in entry.top]
            assert len(ids) == 3 and len(set(ids)) == 3
            values = [lp for _, lp in entry.top]
            assert values == sorted(values, reverse=True) and all(lp <= 0 for lp in values)
            # Greedy: the sampled token is the most likely one.
            assert ids[0] == token_id and entry.logprob == pytest.approx(values[0])
    # Not asked, none given.
    engine.add_request(make_request("plain", prompt, 3))
    assert all(not out.logprobs for out in outputs_by_request(run_to_end(engine))["plain"])


def test_a_request_of_max_model_len_tokens_is_served(new_engine: EngineFactory) -> None:
    engine = new_engine()
    block = engine.block_size
    # The pool (64 blocks) is the bound here: the models have more positions.
    assert engine.max_model_len == block * NUM_BLOCKS
    longest = [3 + i % 290 for i in range(engine.max_model_len - 2)]
    with pytest.raises(ValueError):
        engine.add_request(make_request("over", [*longest, 3], max_tokens=3))
    engine.add_request(make_request("longest", longest, max_tokens=2))
    outputs = outputs_by_request(run_to_end(engine))
    assert len(tokens_of(outputs["longest"])) == 2


def test_kv_events_describe_the_cache_that_prefix_hits_come_from(
    new_engine: EngineFactory,
) -> None:
    engine = new_engine()
    block, cases = engine.block_size, prompts(engine.block_size)
    if not engine.capabilities.kv_events:
        results = run_one(engine, "a", cases["a"])
        assert not any(r.kv_changes for r in results)
        return
    first = run_one(engine, "a", cases["a"])
    view = folded(first)
    sequence = cases["a"] + tokens_of(outputs_by_request(first)["a"])
    # Only full blocks of what the engine computed, hashed with Laneway's chain.
    assert view and view <= set(chain_block_hashes(sequence, block))
    prompt_hashes = chain_block_hashes(cases["a"], block)
    assert leading(prompt_hashes, view) == len(prompt_hashes)
    # A request sharing the prompt's first two blocks finds exactly what the events announced.
    shared = [*cases["a"][: 2 * block], 250, 251, 252]
    second = run_one(engine, "shared", shared)
    expected_hit = min(leading(chain_block_hashes(shared, block), view), (len(shared) - 1) // block)
    assert (
        outputs_by_request(second)["shared"][0].cached_tokens == expected_hit * block == 2 * block
    )
    assert sum(r.prefill_tokens for r in second) == len(shared) - 2 * block
    folded(second, view)
    portable = kv_portable(engine)
    if portable is not None:
        # The exported prefix is the one the events describe.
        unseen = chain_block_hashes([*cases["a"], *range(100, 100 + 2 * block)], block)
        for hashes in (prompt_hashes, chain_block_hashes(shared, block), unseen):
            assert portable.export_prefix(hashes)[0] == leading(hashes, view)


def test_a_prompts_kv_moves_to_another_engine_when_the_engine_can_hand_off(
    new_engine: EngineFactory,
) -> None:
    prefill = new_engine()
    block, cases = prefill.block_size, prompts(prefill.block_size)
    source = kv_portable(prefill)
    if not prefill.capabilities.kv_handoff:
        assert source is None
        return
    assert source is not None
    prompt = cases["a"]
    hashes = chain_block_hashes(prompt, block)
    local = outputs_by_request(run_one(prefill, "r", prompt))["r"]
    count, payload = source.export_prefix(hashes)
    assert count == len(hashes)
    # The KV size the engine declares (what the planner prices a move at) is what moves.
    # A real engine knows its cache; a simulated one moves no real KV.
    declared = prefill.capabilities.kv_bytes_per_token * count * block
    assert declared > 0 or prefill.capabilities.modelled_time
    assert declared == 0 or declared <= len(payload) < declared + 4096
    decode = new_engine()
    target = kv_portable(decode)
    assert target is not None
    assert target.import_prefix(hashes, payload) == len(hashes)
    results = run_one(decode, "r", prompt)
    # The import is announced like any other caching, with the next step.
    assert set(hashes) <= folded(results[:1])
    folded(results)
    remote = outputs_by_request(results)["r"]
    # The last prompt token is always computed; the blocks before it came over.
    assert remote[0].cached_tokens == len(hashes) * block
    assert sum(r.prefill_tokens for r in results) == len(prompt) - len(hashes) * block
    assert tokens_of(remote) == tokens_of(local)


def test_a_whole_prompt_hand_off_continues_from_the_first_token_with_nothing_recomputed(
    new_engine: EngineFactory,
) -> None:
    prefill = new_engine()
    block, cases = prefill.block_size, prompts(prefill.block_size)
    if not prefill.capabilities.whole_prompt_handoff:
        assert whole_prompt_handoff(prefill) is None
        return
    source, prompt = kv_portable(prefill), cases["a"]
    assert source is not None
    local = tokens_of(outputs_by_request(run_one(prefill, "r", prompt))["r"])
    hashes = chain_block_hashes(prompt, block)
    decode = new_engine()
    target, whole = kv_portable(decode), whole_prompt_handoff(decode)
    assert target is not None and whole is not None
    target.import_prefix(hashes, source.export_prefix(hashes)[1])
    resumed = continuation(make_request("r", prompt), local[0], block)
    assert resumed.rest is not None
    whole.add_handed_off(resumed.rest, resumed.handed_off_tokens)
    results = run_to_end(decode)
    # The partial last block came over too: every step of the answer decodes only.
    assert sum(r.prefill_tokens for r in results) == 0
    remote = tokens_of(outputs_by_request(results)["r"])
    assert len(remote) == len(local) - 1
