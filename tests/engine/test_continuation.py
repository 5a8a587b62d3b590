"""How a request continues on its decode engine from the first token a prefill engine sampled."""

from __future__ import annotations

import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import FinishReason, SamplingParams
from services.engine.continuation import continuation
from services.engine.protocol import EngineRequest

PROMPT = (1, 2, 3, 4, 5)
SAMPLING = SamplingParams(max_tokens=6, temperature=0)


def request(prompt: tuple[int, ...] = PROMPT, max_tokens: int = 6) -> EngineRequest:
    sampling = SAMPLING.model_copy(update={"max_tokens": max_tokens})
    return EngineRequest("r", prompt, sampling, chain_block_hashes(prompt, 4))


def test_the_decode_continues_after_the_first_token() -> None:
    resumed = continuation(request(), 9, 4, cached_tokens=4)
    first, rest = resumed.first, resumed.rest
    assert first.new_token_ids == (9,) and not first.finished and first.cached_tokens == 4
    assert rest is not None
    assert tuple(rest.prompt_token_ids) == (1, 2, 3, 4, 5, 9)
    assert rest.sampling.max_tokens == 5 and rest.sampling.temperature == 0
    assert rest.block_hashes == chain_block_hashes(PROMPT, 4)
    assert resumed.handed_off_tokens == len(PROMPT)


def test_a_first_token_that_completes_a_block_gets_its_hash() -> None:
    prompt = (1, 2, 3, 4, 5, 6, 7)
    rest = continuation(request(prompt), 9, 4).rest
    assert rest is not None and rest.block_hashes == chain_block_hashes((*prompt, 9), 4)
    # Without hashes the engine computes them all.
    bare = EngineRequest("r", prompt, SAMPLING)
    assert continuation(bare, 9, 4).rest.block_hashes == ()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("max_tokens", "finish", "reason"), [(6, "stop", "stop"), (1, None, "length")]
)
def test_a_first_token_that_ends_the_answer_ends_it_there(
    max_tokens: int, finish: FinishReason | None, reason: str
) -> None:
    resumed = continuation(request(max_tokens=max_tokens), 9, 4, finish)
    assert resumed.rest is None and resumed.first.finished
    assert resumed.first.finish_reason == reason
