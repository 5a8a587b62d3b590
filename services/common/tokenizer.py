"""Tokenizers behind one protocol. ``ByteTokenizer`` serves the ``sim`` engine: every UTF-8 byte
is a token, so any text round-trips exactly and token counts are honest without a vocabulary file.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class ChatMessage(Protocol):
    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


class StreamDecoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder:
        """A decoder for a growing sequence that never emits half a character."""
        ...

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str: ...


def _bytes(token_ids: Sequence[int]) -> bytes:
    """The byte tokens of ``token_ids``, without the end-of-sequence id (256) or any above it."""
    try:
        # Every id a byte, as a step's one token nearly always is: no generator, half the time.
        return bytes(token_ids)
    except ValueError:
        return bytes(t for t in token_ids if t < 256)


class _Utf8StreamDecoder:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(_bytes(token_ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes are ids 0–255; 256 is end-of-sequence."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return _bytes(token_ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _Utf8StreamDecoder()

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        # ChatML layout, ending with an open assistant turn for the model to complete.
        turns = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas and cuts the text at the first stop string
    (the stop string itself is not returned, as OpenAI does)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(s for s in stop if s)
        # A tail this long could still turn out to be the start of a stop string.
        self._held = max((len(s) for s in self._stop), default=1) - 1
        self._decoder = tokenizer.stream_decoder()
        self._tokenizer = tokenizer
        self._pending = ""
        self.stopped = False

    def token_text(self, token_id: int) -> str:
        """One token's text alone, as log probabilities name it."""
        return self._tokenizer.decode((token_id,))

    def push(self, token_ids: Sequence[int]) -> str:
        """Text that is final after these tokens; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return ""
        if not self._stop:  # nothing to hold back: every step's text goes out as it comes
            return self._decoder.decode(token_ids)
        self._pending += self._decoder.decode(token_ids)
        for stop in self._stop:
            at = self._pending.find(stop)
            if at >= 0:
                self.stopped = True
                out, self._pending = self._pending[:at], ""
                return out
        cut = max(0, len(self._pending) - self._held)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self._pending = self._pending + self._decoder.flush(), ""
        return out
