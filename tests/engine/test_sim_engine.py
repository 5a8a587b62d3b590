from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.engine.protocol import (
    BlocksRemoved,
    BlocksStored,
    Engine,
    EngineRequest,
    StepResult,
)

from ._sim_support import (
    make_engine,
    make_request,
    outputs_by_request,
    removed_hashes,
    run_to_end,
    stored_hashes,
    tokens_by_request,
)

PROMPT_A = tuple(range(100, 120))  # 20 tokens, 5 blocks of 4


def first_output_cached_tokens(results: list[StepResult], request_id: str) -> int | None:
    for result in results:
        for out in result.outputs:
            if out.request_id == request_id:
                return out.cached_tokens
    raise AssertionError(f"{request_id} produced nothing")


def test_sim_engine_is_an_engine() -> None:
    engine: Engine = make_engine(block_size=4, num_gpu_blocks=64, max_num_seqs=8)
    assert (engine.block_size, engine.kv_blocks_total, engine.max_num_seqs) == (4, 64, 8)
    assert not engine.has_work()


def test_prefix_reuse_reports_cached_tokens_and_stores_only_new_blocks() -> None:
    engine = make_engine()
    engine.add_request(make_request("a", PROMPT_A, max_tokens=1))
    first = run_to_end(engine)
    hashes_a = chain_block_hashes(PROMPT_A, 4)
    assert first_output_cached_tokens(first, "a") == 0
    assert [c for r in first for c in r.kv_changes] == [BlocksStored(hashes_a, None)]

    prompt_b = (*PROMPT_A[:16], 1, 2, 3, 4, 5, 6)
    engine.add_request(make_request("b", prompt_b, max_tokens=1))
    second = run_to_end(engine)
    hashes_b = chain_block_hashes(prompt_b, 4)
    assert first_output_cached_tokens(second, "b") == 16
    # Only the block after the shared prefix is new, chained to the prefix's last block.
    assert [c for r in second for c in r.kv_changes] == [BlocksStored(hashes_b[4:5], hashes_a[3])]
    assert second[0].prefill_tokens == len(prompt_b) - 16


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    engine = make_engine()
    engine.add_request(make_request("a", PROMPT_A, max_tokens=1))
    run_to_end(engine)
    engine.add_request(make_request("again", PROMPT_A, max_tokens=1))
    results = run_to_end(engine)
    assert first_output_cached_tokens(results, "again") == 16
    assert results[0].prefill_tokens == 4
    # Its recomputed last block duplicates a cached one: the cached set does not change.
    assert [c for r in results for c in r.kv_changes] == []


def test_decoded_blocks_are_hashed_over_prompt_and_output() -> None:
    engine = make_engine()
    prompt = (7, 8, 9, 10, 11, 12)
    engine.add_request(make_request("r", prompt, max_tokens=7))
    output = tokens_by_request(run_to_end(engine))["r"]
    assert len(output) == 7
    # KV exists for every token but the last sampled one: 12 tokens, 3 full blocks.
    expected = chain_block_hashes(prompt + tuple(output), 4)
    assert len(expected) == 3
    assert engine.cached_block_hashes() == set(expected)

    # A follow-up turn whose prompt is that conversation hits the decoded blocks too.
    follow_up = prompt + tuple(output) + (1, 2, 3)
    engine.add_request(make_request("next", follow_up, max_tokens=1))
    assert first_output_cached_tokens(run_to_end(engine), "next") == 12


def test_given_block_hashes_are_used_instead_of_computed_ones() -> None:
    engine = make_engine()
    engine.add_request(make_request("r", range(9), max_tokens=1, block_hashes=(11, 22)))
    results = run_to_end(engine)
    assert results[0].kv_changes == [BlocksStored((11, 22), None)]


def test_idle_cached_blocks_are_evicted_least_recently_released_first() -> None:
    engine = make_engine(num_gpu_blocks=6)
    prompts = {
        name: tuple(range(base, base + 8)) for name, base in (("a", 0), ("b", 10), ("c", 20))
    }
    hashes = {name: chain_block_hashes(p, 4) for name, p in prompts.items()}
    for name, prompt in prompts.items():
        engine.add_request(make_request(name, prompt, max_tokens=1))
        assert removed_hashes(run_to_end(engine)) == []
    # All six blocks now hold idle cached prefixes: a1 a0 b1 b0 c1 c0 in eviction order (a
    # request's blocks are released tail first).
    assert engine.load().kv_blocks_used == 0

    # Reusing a's prefix needs one more block: the oldest idle one not being reused is b1.
    engine.add_request(make_request("a2", prompts["a"] + (99,), max_tokens=1))
    results = run_to_end(engine)
    assert removed_hashes(results) == [hashes["b"][1]]
    assert first_output_cached_tokens(results, "a2") == 8

    # a's blocks were used last, so they outlive b0 and c1. The block a2 computed (one token,
    # never full) holds nothing and is taken before any cached block.
    engine.add_request(make_request("d", range(50, 62), max_tokens=1))
    results = run_to_end(engine)
    assert [c for r in results for c in r.kv_changes if isinstance(c, BlocksRemoved)] == [
        BlocksRemoved((hashes["b"][0], hashes["c"][1]))
    ]
    assert engine.cached_block_hashes() == {
        *hashes["a"],
        hashes["c"][0],
        *chain_block_hashes(range(50, 62), 4),
    }


def test_preemption_when_kv_runs_out_and_both_requests_still_complete() -> None:
    def serve(num_gpu_blocks: int) -> tuple[dict[str, list[int]], list[StepResult], int]:
        engine = make_engine(num_gpu_blocks=num_gpu_blocks)
        engine.add_request(make_request("first", range(8), max_tokens=16))
        engine.add_request(make_request("second", range(20, 28), max_tokens=16))
        results = run_to_end(engine)
        assert engine.load().kv_blocks_used == 0
        return tokens_by_request(results), results, engine.num_preemptions

    # Each request ends with 23 tokens of KV (6 blocks); 8 blocks cannot hold both.
    tight_tokens, tight_results, preemptions = serve(num_gpu_blocks=8)
    roomy_tokens, _, no_preemptions = serve(num_gpu_blocks=64)
    assert preemptions > 0
    assert no_preemptions == 0
    assert tight_tokens == roomy_tokens
    assert {rid: len(t) for rid, t in tight_tokens.items()} == {"first": 16, "second": 16}
    finishes = [o for r in tight_results for o in r.outputs if o.finished]
    assert {(o.request_id, o.finish_reason) for o in finishes} == {
        ("first", "length"),
        ("second", "length"),
    }
    # cached_tokens is reported once per request, preempted or not.
    reported = [
        o.request_id for r in tight_results for o in r.outputs if o.cached_tokens is not None
    ]
    assert sorted(reported) == ["first", "second"]


def test_preempted_request_is_recomputed_with_its_output() -> None:
    engine = make_engine(num_gpu_blocks=8)
    engine.add_request(make_request("first", range(8), max_tokens=16))
    engine.add_request(make_request("second", range(20, 28), max_tokens=16))
    while engine.num_preemptions == 0:
        engine.step()
    load = engine.load()
    assert (load.running, load.waiting) == (1, 1)
    # The preempted request's prompt and the tokens it generated are all to compute again.
    assert load.waiting_prefill_tokens > 8


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(make_request("short", range(4), max_tokens=10))
    engine.step()
    engine.add_request(make_request("long", range(100, 140), max_tokens=2))
    assert engine.load().waiting_prefill_tokens == 40

    steps = [engine.step() for _ in range(3)]
    # The decoding request takes one token of each step's budget; the prompt gets the rest.
    assert [s.prefill_tokens for s in steps] == [15, 15, 10]
    for s in steps[:2]:
        assert [o.request_id for o in s.outputs] == ["short"]
    assert [o.request_id for o in steps[2].outputs] == ["short", "long"]
    assert engine.load().waiting_prefill_tokens == 0


def test_at_most_max_num_seqs_run_and_waiting_requests_start_in_order() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(make_request(f"r{i}", range(i, i + 6), max_tokens=3))
    started: list[str] = []
    while engine.has_work():
        result = engine.step()
        assert engine.load().running <= 2
        assert len({o.request_id for o in result.outputs}) <= 2
        started += [o.request_id for o in result.outputs if o.cached_tokens is not None]
    assert started == [f"r{i}" for i in range(5)]


def test_outputs_are_deterministic_lowercase_words() -> None:
    def serve() -> list[StepResult]:
        engine = make_engine(num_gpu_blocks=12, max_num_seqs=3, max_num_batched_tokens=8)
        for i in range(6):
            engine.add_request(make_request(f"r{i}", range(i, i + 5 + i * 3), max_tokens=9 + i))
        return run_to_end(engine)

    first, second = serve(), serve()
    assert first == second
    for tokens in tokens_by_request(first).values():
        text = bytes(tokens).decode()
        assert set(text) <= set("abcdefghijklmnopqrstuvwxyz ")
        assert "  " not in text


def test_seed_fixes_the_output_regardless_of_request_id() -> None:
    engine = make_engine()
    engine.add_request(make_request("x", range(5), max_tokens=20, seed=7))
    engine.add_request(make_request("y", range(9), max_tokens=20, seed=7))
    engine.add_request(make_request("z", range(5), max_tokens=20))
    tokens = tokens_by_request(run_to_end(engine))
    assert tokens["x"] == tokens["y"]
    assert tokens["x"] != tokens["z"]


def test_greedy_output_is_the_prompts_and_a_moved_request_goes_on_with_it() -> None:
    # Temperature 0 and no seed: the text is a function of the prompt, as greedy decoding is.
    def greedy(request_id: str, prompt: Sequence[int], offset: int = 0) -> EngineRequest:
        sampling = SamplingParams(max_tokens=12 - offset, temperature=0.0, offset=offset)
        return EngineRequest(request_id, tuple(prompt), sampling)

    engine = make_engine()
    engine.add_request(greedy("x", range(9)))
    engine.add_request(greedy("y", range(9)))
    engine.add_request(greedy("other prompt", range(1, 10)))
    engine.add_request(make_request("sampled", range(9), max_tokens=12))
    tokens = tokens_by_request(run_to_end(engine))
    assert tokens["x"] == tokens["y"]
    assert tokens["x"] != tokens["other prompt"] and tokens["x"] != tokens["sampled"]
    # Migrated after 5 tokens: the client's tokens ride on its prompt, the rest follows them.
    engine.add_request(greedy("x", [*range(9), *tokens["x"][:5]], offset=5))
    assert tokens_by_request(run_to_end(engine))["x"] == tokens["x"][5:]


def test_stop_token_ends_generation() -> None:
    engine = make_engine()
    engine.add_request(make_request("r", range(5), max_tokens=100, stop_token_ids=[ord(" ")]))
    results = run_to_end(engine)
    outputs = [o for r in results for o in r.outputs]
    assert outputs[-1].finished
    assert outputs[-1].finish_reason == "stop"
    assert outputs[-1].new_token_ids == (ord(" "),)
    assert all(not o.finished and o.new_token_ids != (ord(" "),) for o in outputs[:-1])


def test_abort_frees_blocks_and_keeps_cached_prefix() -> None:
    engine = make_engine(max_num_seqs=1)
    engine.add_request(make_request("running", range(12), max_tokens=50))
    engine.add_request(make_request("queued", range(30, 37), max_tokens=5))
    engine.step()
    # Blocks for the computed prompt only: the first decode step allocates the next one.
    assert engine.load().kv_blocks_used == 3
    assert engine.load().waiting_prefill_tokens == 7

    assert engine.abort("queued")
    assert engine.load().waiting == 0
    assert engine.load().waiting_prefill_tokens == 0

    assert engine.abort("running")
    assert not engine.has_work()
    assert engine.load().kv_blocks_used == 0
    assert engine.cached_block_hashes() == set(chain_block_hashes(range(12), 4))
    assert not engine.abort("running")
    assert not engine.abort("never-seen")
    assert engine.step() == StepResult()


def test_aborted_prefix_is_reused_by_a_later_request() -> None:
    engine = make_engine()
    engine.add_request(make_request("r", PROMPT_A, max_tokens=50))
    engine.step()
    engine.abort("r")
    engine.add_request(make_request("again", PROMPT_A, max_tokens=1))
    results = run_to_end(engine)
    assert first_output_cached_tokens(results, "again") == 16
    assert stored_hashes(results) == []


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "block_hashes", "match"),
    [
        ((), 1, (), "empty prompt"),
        (tuple(range(60)), 10, (), "needs 18 KV blocks"),
        (tuple(range(9)), 1, (1,), "1 block hashes for 9 tokens"),
    ],
)
def test_requests_the_engine_cannot_serve_are_refused(
    prompt: tuple[int, ...], max_tokens: int, block_hashes: tuple[int, ...], match: str
) -> None:
    engine = make_engine(num_gpu_blocks=16)
    with pytest.raises(ValueError, match=match):
        engine.add_request(make_request("r", prompt, max_tokens, block_hashes=block_hashes))
    assert not engine.has_work()


def test_duplicate_request_id_is_refused() -> None:
    engine = make_engine()
    engine.add_request(make_request("r", range(5)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(make_request("r", range(5)))


def test_decode_steps_run_at_once_are_the_steps_one_by_one() -> None:
    """``run_steps``: the tokens, ends, KV changes and times of stepping them one at a time."""
    one_by_one, at_once = make_engine(), make_engine()
    for engine in (one_by_one, at_once):
        for i, length in enumerate((3, 9, 6)):
            engine.add_request(make_request(f"r{i}", range(10 * i, 10 * i + 5), length))
        assert engine.run_steps(1.0) is None  # prompts to compute: not plain decode steps
        engine.step()
    run = at_once.run_steps(1.0)
    assert run is not None and run.prefill_tokens == 0
    steps = [one_by_one.step() for _ in run.step_ends_s]
    # Up to the step that ends the shortest answer (its third token: two after the first).
    assert len(run.step_ends_s) == 2
    assert run.step_ends_s == tuple(accumulate(s.duration_s for s in steps))
    assert run.duration_s == run.step_ends_s[-1]
    assert run.kv_changes == [change for s in steps for change in s.kv_changes]
    stepped = outputs_by_request(steps)
    assert {o.request_id: o.new_token_ids for o in run.outputs} == {
        r: tuple(t for o in outs for t in o.new_token_ids) for r, outs in stepped.items()
    }
    assert {o.request_id: (o.finished, o.finish_reason) for o in run.outputs} == {
        r: (outs[-1].finished, outs[-1].finish_reason) for r, outs in stepped.items()
    }
    # What is left runs on alike.
    assert [o for s in run_to_end(at_once) for o in s.outputs] == [
        o for s in run_to_end(one_by_one) for o in s.outputs
    ]
