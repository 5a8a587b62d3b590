"""A request's output stream: every step's tokens at once, the last with the end; the gaps, TTFT
and end-to-end time on the caller's clock."""

from __future__ import annotations

import pytest

from services.common.tokenizer import ByteTokenizer, IncrementalDetokenizer
from services.engine.protocol import Logprobs, RequestOutput
from services.worker.stream import Chunk, RequestStream


def out(*ids: int, finished: bool = False, cached: int | None = None) -> RequestOutput:
    return RequestOutput("r", ids, finished=finished, cached_tokens=cached)


def test_every_step_s_tokens_go_out_with_it() -> None:
    stream = RequestStream(10, received=1.0)
    assert stream.push(out(1, cached=4), 1.2) == Chunk(0, (1,), "")
    assert stream.push(out(), 1.21) is None
    assert stream.push(out(2), 1.22) == Chunk(1, (2,), "")
    assert stream.push(out(3), 1.26) == Chunk(2, (3,), "")
    assert stream.times.last_s == 1.26 and stream.token_gaps.total() == 2
    assert stream.push(out(4, finished=True), 1.27) == Chunk(3, (4,), "")
    assert stream.finished and stream.finish_reason == "length"
    event = stream.finished_event("worker/w", "r", None, None, "w", prefill_worker_id="p")
    assert event.ttft_ms == pytest.approx(200) and event.e2e_ms == pytest.approx(270)
    assert event.usage.completion_tokens == 4 and event.usage.cached_tokens == 4
    assert event.token_gaps.total() == 3 and event.prefill_worker_id == "p"


def test_a_stop_string_ends_the_answer_before_the_engine_does() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["!"])
    stream = RequestStream(3, received=0.0, detokenizer=detok)
    assert stream.push(out(*b"hi"), 0.1) == Chunk(0, tuple(b"hi"), "hi")
    chunk = stream.push(out(*b" you! more"), 0.2, stalled=True)
    assert chunk is not None and chunk.text == " you"
    assert stream.stopped and stream.finish_reason == "stop" and stream.stalled_gaps == 1


def test_byte_tokens_decode_to_text_without_the_end_of_sequence_id() -> None:
    """Ids past the bytes (256, end of sequence) give no text, whether alone, among bytes, or
    the end of a character split across steps."""
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 105, 256]) == tokenizer.decode(b"hi") == "hi"
    detok = IncrementalDetokenizer(tokenizer)
    parts = [detok.push(ids) for ids in ([104], [0xC3], [0xA9, 256], [256], [])]
    assert parts == ["h", "", "é", "", ""] and detok.flush() == ""
    with pytest.raises(ValueError):
        tokenizer.decode([-1])


def test_several_steps_tokens_at_once_close_a_gap_each_as_stepped_alone() -> None:
    stepped, at_once = RequestStream(5, received=0.0), RequestStream(5, received=0.0)
    for stream in (stepped, at_once):
        stream.push(out(1), 0.1)
    for i, at in enumerate((0.12, 0.15, 0.19)):
        stepped.push(out(2 + i, finished=i == 2), at)
    chunk = at_once.push(out(2, 3, 4, finished=True), 0.2, times=(0.12, 0.15, 0.19))
    assert chunk == Chunk(1, (2, 3, 4), "")
    assert at_once.token_gaps == stepped.token_gaps and at_once.token_gaps.total() == 3
    assert at_once.times.last_s == stepped.times.last_s == 0.19
    assert not at_once.times.gaps_ms  # every gap went to the histogram
    assert at_once.emitted == stepped.emitted == 4 and at_once.finish_reason == "length"


def test_a_continued_request_counts_cached_tokens_of_the_clients_prompt_only() -> None:
    """A migrated request runs the client's 97 prompt tokens and 30 answer tokens as its prompt;
    its new engine found 112 of those cached. The client's usage: 97 prompt tokens, all cached."""
    stream = RequestStream(97, received=0.0, offset=30)
    stream.push(out(1, finished=True, cached=112), 0.1)
    usage = stream.finished_event("worker/w", "r", None, None, "w").usage
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (97, 97, 31)


def test_log_probabilities_go_out_with_their_tokens_each_named_by_its_text() -> None:
    stream = RequestStream(3, 0.0, IncrementalDetokenizer(ByteTokenizer()))
    # "é" is two byte tokens: the first's text waits for the second, its log probability not.
    entries = (Logprobs(-0.5, ((0xC3, -0.5), (ord("a"), -1.5))), Logprobs(-0.1, ()))
    output = RequestOutput("r", (0xC3, 0xA9), logprobs=entries)
    chunk = stream.push(output, 1.0)
    assert chunk is not None and chunk.text == "é"
    assert [(e.token, e.logprob) for e in chunk.logprobs] == [("\ufffd", -0.5), ("\ufffd", -0.1)]
    assert [(t.token_id, t.token, t.logprob) for t in chunk.logprobs[0].top] == [
        (0xC3, "\ufffd", -0.5),
        (ord("a"), "a", -1.5),
    ]
    # Not asked: none.
    plain = stream.push(out(ord("b")), 2.0)
    assert plain is not None and plain.logprobs == ()
