"""The output-length predictor: learned from finished requests only, capped by max_tokens."""

from __future__ import annotations

from services.planner.output_length import OutputLengthPredictor


def test_before_anything_finished_it_says_the_prior_capped_by_max_tokens() -> None:
    predictor = OutputLengthPredictor(prior=256)
    assert predictor.predict(None, 1000, 0) == 256
    assert predictor.predict(None, 1000, 100) == 100


def test_a_session_its_own_answers_first_then_its_prompt_length_bucket() -> None:
    predictor = OutputLengthPredictor(window=16)
    for _ in range(4):
        predictor.observe("chatty", 1000, 800)
        predictor.observe(None, 1000, 100)
        predictor.observe(None, 60_000, 20)
    assert predictor.predict("chatty", 1000, 0) == 800
    # A new session: answers to prompts of 512-1023 tokens (800s and 100s alike).
    assert predictor.predict("new", 900, 0) == 450
    assert predictor.predict(None, 50_000, 0) == 20
    # An unseen length: all answers.
    assert predictor.predict(None, 5, 0) == round((4 * 800 + 4 * 100 + 4 * 20) / 12)


def test_recent_answers_count_most_once_the_window_is_full() -> None:
    predictor = OutputLengthPredictor(window=2)
    for length in (10, 10, 10, 1000, 1000, 1000):
        predictor.observe(None, 100, length)
    assert predictor.predict(None, 100, 0) > 800


def test_sessions_are_bounded() -> None:
    predictor = OutputLengthPredictor(max_sessions=2)
    for session, length in (("a", 5), ("b", 500), ("c", 500)):
        predictor.observe(session, 100, length)
    # "a" was forgotten: it gets the bucket's mean, not its own 5.
    assert predictor.predict("a", 100, 0) == round((5 + 500 + 500) / 3)
