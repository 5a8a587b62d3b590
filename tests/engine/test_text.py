"""The sim engine's made-up output text: fixed by the seed, whether drawn a token or many at a
time, and the very words random.choice picked before the draw was inlined (replays' figures and
recorded answers depend on it)."""

from __future__ import annotations

import random

from services.engine.scheduling.text import _WORDS, WordStream


def test_words_are_what_random_choice_picks() -> None:
    for seed in (0, 1, 7, 2**40 + 3):
        rng = random.Random(seed)
        expected = b"".join(rng.choice(_WORDS) + b" " for _ in range(500))
        assert bytes(WordStream(seed).take(len(expected))) == expected


def test_take_in_pieces_equals_one_token_at_a_time() -> None:
    pieces = random.Random(3)
    for seed in range(20):
        one, many = WordStream(seed), WordStream(seed)
        tokens = [one.next_token() for _ in range(2000)]
        taken: list[int] = []
        while len(taken) < len(tokens):
            step = min(pieces.randrange(0, 30), len(tokens) - len(taken))
            if step == 1:
                taken.append(many.next_token())
            else:
                taken += many.take(step)
        assert taken == tokens
