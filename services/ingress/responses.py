"""OpenAI's response bodies for the two completion endpoints: one JSON answer, or server-sent
events (an opening chunk, text chunks, the closing chunk, usage, ``[DONE]``).

What differs between chat and plain completions is only where the text sits in a choice and
what the objects are called; :class:`ChatFormat` and :class:`CompletionFormat` say that, and
:class:`Format` builds every body from it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import orjson
from starlette.types import Send

from schemas.events import RequestFinished
from schemas.logprobs import TokenLogprob
from services.ingress.errors import ApiError

Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Reverse proxies (nginx) would otherwise buffer the stream and defeat token streaming.
    (b"x-accel-buffering", b"no"),
]
_SSE_DONE = b"data: [DONE]\n\n"
# Stands for the text while a text chunk's constant parts are encoded.
_TEXT_SLOT = "laneway-text-slot"


class Format(ABC):
    """OpenAI's response shapes for one request. A streamed text chunk is spliced from
    pre-encoded pieces: it is written once per token batch, the hottest line of the ingress."""

    __slots__ = ("_base", "_text_head", "_text_tail")

    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]
    answer_object: ClassVar[str]

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        """``include_usage``: the stream ends with a usage chunk, and (as OpenAI's do) every
        chunk before it says ``"usage": null``."""
        self._base: dict[str, object] = {
            "id": self.id_prefix + request_id,
            "object": self.chunk_object,
            "created": int(time.time()),
            "model": model,
        }
        if include_usage:
            self._base["usage"] = None
        chunk = self._event(choices=[_choice(self._text(_TEXT_SLOT), None)])
        # The text is the last string of the chunk, so the last match is the slot itself.
        self._text_head, _, self._text_tail = chunk.rpartition(orjson.dumps(_TEXT_SLOT))

    @abstractmethod
    def _text(self, text: str) -> Mapping[str, object]:
        """A streamed chunk's choice content carrying ``text``."""

    @abstractmethod
    def _last(self) -> Mapping[str, object]:
        """The closing chunk's choice content, beside the finish reason."""

    @abstractmethod
    def _answer(self, text: str) -> Mapping[str, object]:
        """The choice content of a whole (not streamed) answer."""

    @abstractmethod
    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, object]:
        """A choice's ``logprobs`` object for ``entries``, the tokens after those before."""

    def opening(self) -> bytes:
        """The events that open a stream, before any text."""
        return b""

    def delta(self, text: str) -> bytes:
        return self._text_head + orjson.dumps(text) + self._text_tail

    def delta_logprobs(self, text: str, logprobs: Sequence[TokenLogprob]) -> bytes:
        """A streamed chunk of ``text`` with its tokens' log probabilities."""
        content = self._text(text)
        return self._event(choices=[_choice(content, None, self._logprobs(logprobs))])

    def closing(self, finished: RequestFinished) -> bytes:
        out = self._event(choices=[_choice(self._last(), finished.finish_reason)])
        if "usage" in self._base:
            out += self._event(choices=[], usage=_usage(finished))
        return out + _SSE_DONE

    def full(
        self,
        text: str,
        finished: RequestFinished,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> bytes:
        """``logprobs``: the answer's tokens', where the request asked for them."""
        choice_logprobs = None if logprobs is None else self._logprobs(logprobs)
        return orjson.dumps(
            {
                **self._base,
                "object": self.answer_object,
                "choices": [_choice(self._answer(text), finished.finish_reason, choice_logprobs)],
                "usage": _usage(finished),
            }
        )

    def _event(self, **fields: object) -> bytes:
        return b"data: " + orjson.dumps({**self._base, **fields}) + b"\n\n"


class ChatFormat(Format):
    __slots__ = ()
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    answer_object = "chat.completion"

    def opening(self) -> bytes:
        return self._event(choices=[_choice({"delta": {"role": "assistant", "content": ""}}, None)])

    def _text(self, text: str) -> Mapping[str, object]:
        return {"delta": {"content": text}}

    def _last(self) -> Mapping[str, object]:
        return {"delta": {}}

    def _answer(self, text: str) -> Mapping[str, object]:
        return {"message": {"role": "assistant", "content": text}}

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, object]:
        return {
            "content": [
                {
                    **_chat_token(e.token, e.logprob),
                    "top_logprobs": [_chat_token(t.token, t.logprob) for t in e.top],
                }
                for e in entries
            ],
            "refusal": None,
        }


class CompletionFormat(Format):
    __slots__ = ("_offset",)
    id_prefix = "cmpl-"
    chunk_object = answer_object = "text_completion"

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        super().__init__(request_id, model, include_usage)
        # Where the next token's text starts in the answer (a streamed one's text_offset).
        self._offset = 0

    def _text(self, text: str) -> Mapping[str, object]:
        return {"text": text}

    def _last(self) -> Mapping[str, object]:
        return self._text("")

    def _answer(self, text: str) -> Mapping[str, object]:
        return self._text(text)

    def _logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, object]:
        offsets = []
        offset = self._offset
        for e in entries:
            offsets.append(offset)
            offset += len(e.token)
        self._offset = offset
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # The sampled token beside the most likely ones, as vLLM's server gives them.
            "top_logprobs": [
                {**{t.token: t.logprob for t in e.top}, e.token: e.logprob} for e in entries
            ],
            "text_offset": offsets,
        }


def sse_error(error: ApiError) -> bytes:
    """The event that ends a stream that failed after it started."""
    return b"data: " + error.body() + b"\n\n"


async def send_json(send: Send, status: int, body: bytes, headers: Headers = JSON_HEADERS) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _choice(
    content: Mapping[str, object],
    finish_reason: str | None,
    logprobs: Mapping[str, object] | None = None,
) -> dict[str, object]:
    return {"index": 0, **content, "logprobs": logprobs, "finish_reason": finish_reason}


def _chat_token(token: str, logprob: float) -> dict[str, object]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _usage(finished: RequestFinished) -> dict[str, object]:
    usage = finished.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
