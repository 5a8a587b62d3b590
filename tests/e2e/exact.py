"""Seeded completions and the check that a stream of one is exact: the sim's answer is fixed by
the seed alone, one byte a token, so the answer to ``max_tokens`` N is the first N bytes of the
unstreamed answer to the largest ``max_tokens``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from tests.ingress.helpers import sse_data

MODEL = "laneway-sim"
SEEDS = 64
MAX_TOKENS = 48


def prompt(seed: int) -> str:
    return f"tell me story number {seed}"


@dataclass(frozen=True)
class Streamed:
    seed: int
    max_tokens: int
    status: int
    events: list[object]


async def answers(
    http: httpx.AsyncClient, seeds: int = SEEDS, max_tokens: int = MAX_TOKENS, **fields: object
) -> dict[int, str]:
    """The unstreamed answer of each of the first ``seeds`` seeds, at the most tokens any
    stream asks for; ``fields`` replace or add to the body's (another model, greedy)."""

    async def one(seed: int) -> str:
        body = {
            "model": MODEL,
            "prompt": prompt(seed),
            "max_tokens": max_tokens,
            "seed": seed,
            **fields,
        }
        reply = (await http.post("/completions", json=body)).raise_for_status().json()
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == max_tokens
        text: str = reply["choices"][0]["text"]
        return text

    texts = await asyncio.gather(*(one(seed) for seed in range(seeds)))
    return dict(enumerate(texts))


def stream_body(seed: int, max_tokens: int, **fields: object) -> dict[str, object]:
    """A streamed completion of the seed's prompt, its usage in the last chunk."""
    return {
        "model": MODEL,
        "prompt": prompt(seed),
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        **fields,
    }


async def stream(http: httpx.AsyncClient, seed: int, max_tokens: int, **fields: object) -> Streamed:
    body = stream_body(seed, max_tokens, **fields)
    request = http.build_request("POST", "/completions", json=body)
    try:
        response = await http.send(request, stream=True)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        # The server closed a kept-alive connection just as it was reused: no answer had begun.
        response = await http.send(request, stream=True)
    try:
        raw = (await response.aread()).decode()  # a stream cut from here on fails the test
    finally:
        await response.aclose()
    events = sse_data(raw) if response.status_code == 200 else [raw]
    return Streamed(seed, max_tokens, response.status_code, events)


def mismatch(streamed: Streamed, whole: str, byte_tokens: bool = True) -> str | None:
    """What is wrong with one stream, if anything. ``byte_tokens``: ``whole`` is the answer to
    a larger ``max_tokens`` on the sim's one-byte tokens, cut to the stream's; else it is the
    stream's whole answer (a real tokenizer's)."""
    about = f"seed {streamed.seed}, max_tokens {streamed.max_tokens}"
    if streamed.status != 200 or streamed.events[-1:] != ["[DONE]"]:
        return f"{about}: status {streamed.status}, ends {streamed.events[-2:]}"
    chunks = [e for e in streamed.events[:-1] if isinstance(e, dict)]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    usage = chunks[-1].get("usage") or {}
    expected = whole[: streamed.max_tokens] if byte_tokens else whole
    if text != expected:
        return f"{about}: streamed {text!r}, unstreamed {expected!r}"
    if usage.get("completion_tokens") != streamed.max_tokens:
        return f"{about}: usage {usage}"
    finish = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]][-1]
    return None if finish == "length" else f"{about}: finish_reason {finish}"
