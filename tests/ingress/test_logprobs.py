"""Log probabilities: asked for on both endpoints, refused for a model whose workers do not give
them (naming their engines), and written in OpenAI's shapes, whole and streamed, each token's
once, a token whose text is held back going out with the text that follows."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from schemas.messages import WorkerRegistration
from services.ingress.errors import InvalidRequest
from services.ingress.openai_models import parse_chat_request, parse_completion_request
from tests.ingress.fakes import Finish, Tokens
from tests.ingress.features import features_of, intake, worker
from tests.ingress.helpers import MODEL, chat_body, completion_body, harness, sse_data


def _worker(worker_id: str, engine: str, logprobs: bool) -> WorkerRegistration:
    return worker(worker_id, engine, False, logprobs=logprobs)


def _bytes(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


def test_each_endpoint_asks_its_own_way() -> None:
    chat = parse_chat_request(_bytes(chat_body(logprobs=True, top_logprobs=3)))
    assert chat.params.logprobs == 3
    assert parse_chat_request(_bytes(chat_body(logprobs=True))).params.logprobs == 0
    assert parse_chat_request(_bytes(chat_body(logprobs=False))).params.logprobs is None
    # top_logprobs 0 without logprobs asks nothing, as OpenAI takes it.
    assert parse_chat_request(_bytes(chat_body(top_logprobs=0))).params.logprobs is None
    completion = parse_completion_request(_bytes(completion_body(logprobs=2)))
    assert completion.params.logprobs == 2
    # 0: the sampled tokens' own log probabilities (0 is falsy: not "none").
    assert parse_completion_request(_bytes(completion_body(logprobs=0))).params.logprobs == 0
    assert parse_completion_request(_bytes(completion_body())).params.logprobs is None


async def test_a_model_whose_workers_give_none_refuses_them_naming_the_engines() -> None:
    sims = await features_of(_worker("s1", "sim", False), _worker("s2", "sim", False))
    with pytest.raises(InvalidRequest) as refused:
        intake(sims).spec(parse_completion_request(_bytes(completion_body(logprobs=1))))
    assert refused.value.param == "logprobs" and refused.value.status == 400
    assert refused.value.message == (
        f"logprobs need workers whose engine gives them (vllm); model '{MODEL}' is served by sim."
    )
    mixed = await features_of(_worker("v", "vllm", True), _worker("t", "torch", False))
    with pytest.raises(InvalidRequest, match="served by torch as well as vllm"):
        intake(mixed).spec(parse_chat_request(_bytes(chat_body(logprobs=True))))
    # Not asked: served as ever.
    assert intake(sims).spec(parse_chat_request(_bytes(chat_body())))
    vllm = await features_of(_worker("v1", "vllm", True), _worker("v2", "vllm", True))
    spec = intake(vllm).spec(parse_chat_request(_bytes(chat_body(logprobs=True, top_logprobs=2))))
    assert spec.sampling.logprobs == 2
    # Built unvalidated (schemas.trusted), it is what validation builds.
    assert type(spec).model_validate_json(spec.model_dump_json()) == spec


def _chat_entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict[str, Any]:
    def one(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


async def test_a_chat_answer_carries_every_tokens_log_probability() -> None:
    async with harness() as h:  # "Hel", "lo": the i-th token's is -i/10, the next byte's less
        body = chat_body(logprobs=True, top_logprobs=1)
        answer = (await h.client.post("/v1/chat/completions", json=body)).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert content == [_chat_entry(c, -i / 10, [(c, -i / 10)]) for i, c in enumerate("Hello")]
    assert answer["choices"][0]["logprobs"]["refusal"] is None


async def test_a_streamed_tokens_held_back_text_brings_its_log_probability_along() -> None:
    # The third token's text is held back (part of a character, say); the last one's never
    # comes out before the end.
    script = [Tokens("He"), Tokens("l", held=True), Tokens("lo"), Tokens("!", held=True), Finish()]
    async with harness(script) as h:
        body = chat_body(logprobs=True, stream=True)
        raw = (await h.client.post("/v1/chat/completions", json=body)).text
    chunks = [e for e in sse_data(raw) if e != "[DONE]"]
    carried = [
        [entry["token"] for entry in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
        for c in chunks
    ]
    # The opening chunk, "He", "lo" with the held "l", the held "!" alone, the finish.
    assert carried == [[], ["H", "e"], ["l", "l", "o"], ["!"], []]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert texts == ["", "He", "lo", "", None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_completions_log_probabilities_and_text_offsets_run_over_the_stream() -> None:
    async with harness() as h:
        whole = (await h.client.post("/v1/completions", json=completion_body(logprobs=1))).json()
        body = completion_body(logprobs=1, stream=True)
        raw = (await h.client.post("/v1/completions", json=body)).text
    expected = {
        "tokens": list("Hello"),
        "token_logprobs": [-i / 10 for i in range(5)],
        # The most likely (here the token itself) and the sampled one, as vLLM's server has it.
        "top_logprobs": [{c: -i / 10} for i, c in enumerate("Hello")],
        "text_offset": [0, 1, 2, 3, 4],
    }
    assert whole["choices"][0]["logprobs"] == expected
    streamed = [
        c["choices"][0]["logprobs"] for c in sse_data(raw) if c != "[DONE]" and c["choices"]
    ]
    parts = [p for p in streamed if p is not None]
    assert [p["tokens"] for p in parts] == [["H", "e", "l"], ["l", "o"]]
    assert [p["text_offset"] for p in parts] == [[0, 1, 2], [3, 4]]
    assert [lp for p in parts for lp in p["token_logprobs"]] == expected["token_logprobs"]


async def test_without_logprobs_a_choice_says_null() -> None:
    async with harness() as h:
        answer = (await h.client.post("/v1/completions", json=completion_body())).json()
    assert answer["choices"][0]["logprobs"] is None
