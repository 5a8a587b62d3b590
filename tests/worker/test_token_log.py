"""What a worker keeps of its requests' published batches for resend queries, pure."""

from __future__ import annotations

import gc

from schemas.events import RequestCancelled, TokenRun
from services.worker.token_log import TokenLog


def batch(request_id: str, index: int, text: str) -> TokenRun:
    return TokenRun(request_id=request_id, index=index, token_ids=tuple(text.encode()), text=text)


def new_log(keep_s: float = 30.0, max_bytes: int = 64 << 20) -> TokenLog:
    return TokenLog("worker/w", "w", keep_s, max_bytes)


def ended(request_id: str) -> RequestCancelled:
    return RequestCancelled(source="worker/w", request_id=request_id, reason="timeout")


def test_a_held_request_is_answered_from_the_asked_token_on() -> None:
    log = new_log()
    assert log.reply("r", 0) is None
    log.started("r")
    empty = log.reply("r", 0)
    assert empty is not None and empty.batches == () and empty.terminal is None
    for index, text in ((0, "ab"), (2, "cd"), (4, "ef")):
        log.published(batch("r", index, text))
    reply = log.reply("r", 3)
    assert reply is not None
    # The batch that holds token 3 starts before it; the asker keeps what it lacks.
    assert [b.index for b in reply.batches] == [2, 4]
    # Resent as the publisher's own batches: they pass the ingress's check of who sent them.
    named = {(b.source, b.worker_id, b.request_id) for b in reply.batches}
    assert named == {("worker/w", "w", "r")}
    terminal = ended("r")
    log.ended(terminal, now=10.0)
    after = log.reply("r", 6)
    assert after is not None and after.batches == () and after.terminal == terminal
    assert log.reply("other", 0) is None


def test_ended_requests_go_after_their_time_or_past_the_byte_bound() -> None:
    log = new_log(keep_s=5.0, max_bytes=20_000)  # a 500-token batch: about 4.8 kB
    for request_id in ("a", "b", "c"):
        log.started(request_id)
        log.published(batch(request_id, 0, "x" * 500))
    log.ended(ended("a"), now=0.0)
    log.expire(now=4.0)
    assert log.reply("a", 0) is not None
    log.expire(now=5.0)
    assert log.reply("a", 0) is None
    log.ended(ended("b"), now=6.0)
    # Running ones are never let go, however large; the oldest ended goes first past the bound.
    log.published(batch("c", 500, "y" * 1_500))
    log.expire(now=6.5)
    assert log.reply("b", 0) is None
    assert log.reply("c", 0) is not None and len(log) == 1


def test_a_long_answer_comes_back_in_bounded_replies() -> None:
    log = new_log()
    log.started("r")
    for i in range(200):
        log.published(batch("r", i * 4_000, "z" * 4_000))
    first = log.reply("r", 0)
    assert first is not None and not first.complete and 0 < len(first.batches) < 200
    rest = log.reply("r", first.batches[-1].index + 4_000)
    assert rest is not None
    assert len(first.batches) + len(rest.batches) == 200 or not rest.complete


def test_the_kept_attempt_is_known_while_running_and_after_the_end() -> None:
    log = new_log()
    assert log.attempt("r") is None
    log.started("r", attempt=2)
    assert log.attempt("r") == 2
    log.ended(ended("r"), now=0.0)
    assert log.attempt("r") == 2
    log.expire(now=60.0)
    assert log.attempt("r") is None


def test_a_reply_gives_back_each_run_as_published() -> None:
    log = new_log()
    log.started("r", attempt=2)
    runs = [
        TokenRun(request_id="r", index=0, token_ids=(1, 2), text="ab", attempt=2),
        TokenRun(request_id="r", index=2, token_ids=(195,), text="", attempt=2),  # half a char
        TokenRun(request_id="r", index=3, token_ids=(169, 33), text="é!", attempt=2),
        TokenRun(request_id="r", index=9, token_ids=(7,), text="z", attempt=2),  # after a gap
    ]
    for run in runs:
        log.published(run)
    log.published(TokenRun(request_id="r", index=10, token_ids=(8,), text="y", attempt=1))
    reply = log.reply("r", 0, attempt=2)
    assert reply is not None
    back = [(b.index, b.token_ids, b.text, b.attempt) for b in reply.batches]
    assert back == [(r.index, r.token_ids, r.text, r.attempt) for r in runs]
    assert log.reply("r", 0, attempt=1) is None


def test_kept_runs_are_not_objects_the_garbage_collector_walks() -> None:
    log = new_log()
    log.started("r")
    gc.collect()
    tracked = len(gc.get_objects())
    for index in range(2_000):
        log.published(batch("r", index, "x"))
    gc.collect()
    assert len(gc.get_objects()) - tracked < 20
    reply = log.reply("r", 1_999)
    assert reply is not None and [b.index for b in reply.batches] == [1_999]
