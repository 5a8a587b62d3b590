"""A request continued on another worker: the ingress's continuation of the request and the sim's
answer to it, pure. The seeded answer's second part, from its own engine, is byte for byte what
the first engine would have gone on with."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from schemas.block_hash import chain_block_hashes
from schemas.events import RequestSpec, SamplingParams
from services.common.hf_tokenizer import HfTokenizer
from services.common.tokenizer import ByteTokenizer, IncrementalDetokenizer
from services.engine.continuation import continuation
from services.engine.protocol import EngineRequest
from services.ingress.migration import continued
from services.worker.stream import request_detokenizer
from tests.engine._sim_support import make_engine, run_to_end, tokens_by_request

PROMPT = tuple(b"tell me a story, a long one")


def spec(max_tokens: int, seed: int | None) -> RequestSpec:
    return RequestSpec(
        model="m",
        prompt_token_ids=PROMPT,
        block_size=4,
        block_hashes=chain_block_hashes(PROMPT, 4),
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed),
        reply_to="i",
        deadline=datetime(2030, 1, 1, tzinfo=UTC),
    )


def answer(request_id: str, request: RequestSpec) -> list[int]:
    engine = make_engine()
    engine.add_request(
        EngineRequest(request_id, request.prompt_token_ids, request.sampling, request.block_hashes)
    )
    return tokens_by_request(run_to_end(engine))[request_id]


def test_the_continuation_ends_the_prompt_with_the_delivered_tokens() -> None:
    original = spec(40, seed=None)
    moved = continued(original, [104, 105], attempt=2)
    assert moved.prompt_token_ids == (*PROMPT, 104, 105)
    assert moved.block_hashes == chain_block_hashes(moved.prompt_token_ids, 4)
    assert (moved.sampling.max_tokens, moved.sampling.offset, moved.attempt) == (38, 2, 2)
    assert moved.reply_to == original.reply_to and moved.deadline == original.deadline


def test_a_continued_sim_answer_is_the_rest_of_the_whole_one() -> None:
    for seed in (None, 7):
        whole = answer("req-1", spec(40, seed))
        for k in (1, 13, 39):
            first = whole[:k]
            rest = answer("req-1", continued(spec(40, seed), first, attempt=1))
            assert first + rest == whole, (seed, k)


def test_a_handed_off_sim_answer_goes_on_after_the_prefill_workers_first_token() -> None:
    request = spec(12, seed=3)
    whole = answer("req-2", request)
    engine_request = EngineRequest(
        "req-2", request.prompt_token_ids, request.sampling, request.block_hashes
    )
    rest = continuation(engine_request, whole[0], block_size=4).rest
    assert rest is not None
    engine = make_engine()
    engine.add_request(rest)
    assert [whole[0], *tokens_by_request(run_to_end(engine))["req-2"]] == whole


def test_a_continued_answers_text_goes_on_where_the_first_workers_left_off() -> None:
    """Split anywhere, even inside a character or a stop string, the two workers' texts make the
    one text of the whole answer."""
    tokenizer = ByteTokenizer()
    answer_ids = list("un café, puis STOP là".encode())

    def texts(detokenizer: IncrementalDetokenizer, ids: list[int], last: bool) -> str:
        out = "".join(detokenizer.push([token]) for token in ids)
        return out + (detokenizer.flush() if last else "")

    for stop in ((), ("STOP",)):
        request = spec(len(answer_ids), seed=None).model_copy(
            update={"sampling": SamplingParams(max_tokens=len(answer_ids), stop=stop)}
        )
        whole = texts(request_detokenizer(tokenizer, request), answer_ids, last=True)
        for k in range(1, len(answer_ids)):
            sent = texts(request_detokenizer(tokenizer, request), answer_ids[:k], last=False)
            moved = continued(request, answer_ids[:k], attempt=1)
            rest = texts(request_detokenizer(tokenizer, moved), answer_ids[k:], last=True)
            assert sent + rest == whole, (stop, k)


def test_a_continued_answer_split_inside_a_character_of_a_real_tokenizer_is_sent_once(
    made_model: Path,
) -> None:
    """A byte-level BPE tokenizer's characters can span tokens, and a step's tokens can end
    inside one. Wherever the answer moved, and however the first worker's steps grouped its
    tokens, the two workers' texts make the one text of the whole answer: nothing sent twice
    (the new worker once sent again everything before a character split across the move)."""
    tokenizer = HfTokenizer(made_model)
    answer_ids = tokenizer.encode("un café 🙂 puis là ✓ et ça fin")
    assert any(tokenizer.decode(answer_ids[:k]).endswith("\ufffd") for k in range(len(answer_ids)))
    request = spec(len(answer_ids), seed=None)

    def texts(detokenizer: IncrementalDetokenizer, ids: list[int], step: int, last: bool) -> str:
        out = "".join(detokenizer.push(ids[i : i + step]) for i in range(0, len(ids), step))
        return out + (detokenizer.flush() if last else "")

    whole = tokenizer.decode(answer_ids)
    for step in (1, 2, 3):
        assert texts(request_detokenizer(tokenizer, request), answer_ids, step, last=True) == whole
        for k in range(1, len(answer_ids)):
            sent = texts(request_detokenizer(tokenizer, request), answer_ids[:k], step, last=False)
            moved = continued(request, answer_ids[:k], attempt=1)
            rest = texts(request_detokenizer(tokenizer, moved), answer_ids[k:], 1, last=True)
            assert sent + rest == whole, (step, k)
