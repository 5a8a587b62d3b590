"""Deterministic made-up output text, as byte tokens of the byte-level tokenizer."""

from __future__ import annotations

import random

_VOCABULARY = (
    "the of and to in is it that was for on are with as be at by this have from or one "
    "had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most "
    "know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part"
)
_WORDS = tuple(w.encode() for w in _VOCABULARY.split())
# Each word with the space after it, by the draw that picks it.
_SPACED = tuple(w + b" " for w in _WORDS)
_BITS = len(_WORDS).bit_length()


class WordStream:
    """Lowercase words separated by spaces, one byte at a time, fixed by the seed."""

    __slots__ = ("_pending", "_rng")

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._pending: list[int] = []

    def next_token(self) -> int:
        if not self._pending:
            # Reversed so that pop() hands the bytes out in order.
            self._pending = list(reversed(_SPACED[self._draw()]))
        return self._pending.pop()

    def _draw(self) -> int:
        """A word's place in the vocabulary: what ``random.choice`` picks, without its two
        Python frames (it draws ``_BITS`` bits until they fall inside the vocabulary)."""
        getrandbits = self._rng.getrandbits
        r = getrandbits(_BITS)
        while r >= len(_WORDS):
            r = getrandbits(_BITS)
        return r

    def take(self, tokens: int) -> list[int]:
        """The next ``tokens`` tokens at once: what as many ``next_token`` calls give."""
        pending = self._pending
        if tokens <= len(pending):
            cut = len(pending) - tokens
            out = pending[cut:][::-1]
            del pending[cut:]
            return out
        out = pending[::-1]
        getrandbits = self._rng.getrandbits
        while len(out) < tokens:
            r = getrandbits(_BITS)
            while r >= len(_WORDS):  # as _draw, inline: a decode run draws millions of words
                r = getrandbits(_BITS)
            out += _SPACED[r]
        # What the last word left unsent, reversed so that pop() hands it out in order.
        self._pending = out[tokens:][::-1]
        del out[tokens:]
        return out

    def skip(self, tokens: int) -> None:
        """Move past ``tokens`` tokens: a continued answer goes on where its first part ended."""
        for _ in range(tokens):
            self.next_token()
