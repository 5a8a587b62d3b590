"""The engines' prefix cache under cache salts (EngineRequest.root_hash): blocks the engine hashes
itself join the request's salted chain, so that the same prompt under two salts meets nothing of
the other's, while a greedy answer stays the prompt's whatever the salt."""

from __future__ import annotations

from schemas.block_hash import chain_block_hashes, salt_root
from schemas.events import SamplingParams
from services.engine.continuation import continuation
from services.engine.protocol import EngineRequest, StepResult
from tests.engine._sim_support import (
    make_engine,
    outputs_by_request,
    run_to_end,
    stored_hashes,
    tokens_by_request,
)

PROMPT = tuple(range(3, 21))  # 18 tokens: 4 full blocks of 4, a partial one
ROOTS = {"a": salt_root("a" * 32), "b": salt_root("b" * 32)}


def first_output_cached_tokens(results: list[StepResult], request_id: str) -> int | None:
    return outputs_by_request(results)[request_id][0].cached_tokens


def request(request_id: str, root: int, max_tokens: int = 6, greedy: bool = False) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, seed=None)
    return EngineRequest(request_id, PROMPT, sampling, (), root)


def test_salts_keep_caches_apart_and_the_engines_hashes_are_the_ingress_chain() -> None:
    engine = make_engine()
    engine.add_request(request("a1", ROOTS["a"]))
    first = run_to_end(engine)
    assert first_output_cached_tokens(first, "a1") == 0
    # Prompt and answer hashed in the salted chain the ingress computes for the whole text.
    text = PROMPT + tuple(tokens_by_request(first)["a1"])
    salted = chain_block_hashes(text[:-1], 4, ROOTS["a"])
    assert stored_hashes(first) == list(salted)
    engine.add_request(request("b1", ROOTS["b"]))
    assert first_output_cached_tokens(run_to_end(engine), "b1") == 0
    engine.add_request(request("plain", salt_root(None)))
    assert first_output_cached_tokens(run_to_end(engine), "plain") == 0
    engine.add_request(request("a2", ROOTS["a"]))
    assert first_output_cached_tokens(run_to_end(engine), "a2") == 16


def test_a_greedy_answer_is_the_prompts_under_any_salt() -> None:
    engine = make_engine()
    for name, root in (("a", ROOTS["a"]), ("b", ROOTS["b"]), ("plain", salt_root(None))):
        engine.add_request(request(name, root, greedy=True))
    tokens = tokens_by_request(run_to_end(engine))
    assert tokens["a"] == tokens["b"] == tokens["plain"]


def test_a_continued_request_keeps_its_salt() -> None:
    """A decode worker that hashes the prompt itself (its block size is not the ingress's)
    continues the prefill side's request in the same salted chain."""
    resumed = continuation(request("r", ROOTS["a"]), 7, 4)
    assert resumed.rest is not None and resumed.rest.root_hash == ROOTS["a"]
