"""A streaming load client for any OpenAI-compatible server: the same one drives Laneway and
Dynamo's frontend, so their figures compare.

    python -m infra.bench.load_client --base-url http://127.0.0.1:8000/v1 --api-key KEY \\
        --concurrency 32 --duration 20

Closed loop: ``--concurrency`` streams, each sending its next request when the last ended, for
``--duration`` seconds or until ``--requests`` have been sent. ``--model a,b,c --zipf S``: each
request asks for one of the models (LoRA adapters, say), the k-th with weight 1/k**S. Every
prompt is unique (random words of about ``--prompt-chars`` characters), so no two requests share
a prefix past the chat template. Prints one JSON object: requests per second (those finished
inside the window), TTFT, latency and inter-chunk gap percentiles in ms, and errors by kind.

TTFT is from sending to the first chunk carrying text, or to the first event of a stream that
carries none (Dynamo's mocker streams only a role event and the finish: its tokens decode to no
text); a gap is between two chunks carrying text (a chunk holding several tokens is one gap).
An error: a status other than 200, a broken or timed-out stream, an ``error`` payload, or a
stream ending without ``data: [DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import string
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass
class Sample:
    """One request as the client saw it; times in seconds of ``time.perf_counter``."""

    sent: float
    first_event: float | None = None
    # When each chunk carrying text came.
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    # The response's id (its chunks' ``id``) and the usage its last chunk reported.
    response_id: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    @property
    def first(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else self.usage.get("completion_tokens")


@dataclass
class LoadSpec:
    base_url: str
    model: str
    api_key: str | None = None
    concurrency: int = 1
    requests: int = 0  # 0: run for ``duration`` seconds
    duration_s: float = 20.0
    warmup: int = 5
    max_tokens: int = 8
    prompt_chars: int = 78
    new_connection: bool = False
    timeout_s: float = 60.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    # More models than ``model``: each request draws one, the k-th with weight 1/k**zipf_s.
    models: tuple[str, ...] = ()
    zipf_s: float = 0.0

    def draw_model(self, rng: random.Random) -> str:
        if not self.models:
            return self.model
        weights = [1 / k**self.zipf_s for k in range(1, len(self.models) + 1)]
        return rng.choices(self.models, weights)[0]


def chat_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def prompt(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    length = 0
    while length < chars:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:chars]


def _chunk_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    request_headers: dict[str, str],
    timeout_s: float,
) -> Sample:
    sample = Sample(sent=time.perf_counter())
    done = False
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=body, headers=request_headers, timeout=timeout) as r:
            if r.status != 200:
                sample.error = f"HTTP {r.status}: {(await r.text())[:120]}"
                return sample
            # SSE events are lines; aiohttp's reader splits them whatever the chunking.
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if sample.first_event is None:
                    sample.first_event = time.perf_counter()
                if data == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    sample.error = f"error event: {str(event['error'])[:120]}"
                    return sample
                if sample.response_id is None:
                    sample.response_id = event.get("id")
                if _chunk_text(event):
                    sample.chunk_times.append(time.perf_counter())
                if event.get("usage"):
                    sample.usage = event["usage"]
    # ValueError: a line past aiohttp's limit (64 KiB), which no answer of ours should send.
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:160]
        return sample
    finally:
        sample.end = time.perf_counter()
    if not done:
        sample.error = "stream ended without [DONE]"
    return sample


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 3)


def summarize(
    samples: Sequence[Sample], spec: LoadSpec, t0: float, elapsed: float
) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    # A closed loop drains its streams after the deadline: the rate counts those ended inside.
    window = elapsed if spec.requests else spec.duration_s
    in_window = [s for s in ok if spec.requests or s.end - t0 <= spec.duration_s]
    firsts = [s.first or s.first_event for s in ok]
    ttft = [first - s.sent for s, first in zip(ok, firsts, strict=True) if first is not None]
    latency = [s.end - s.sent for s in ok]
    gaps = [g for s in ok for g in s.gaps]
    tokens = [s.completion_tokens for s in ok if s.completion_tokens is not None]
    out: dict[str, Any] = {
        "label": spec.label,
        "url": chat_url(spec.base_url),
        "model": ",".join(spec.models) or spec.model,
        "zipf_s": spec.zipf_s if spec.models else None,
        "concurrency": spec.concurrency,
        "new_connection": spec.new_connection,
        "max_tokens": spec.max_tokens,
        "prompt_chars": spec.prompt_chars,
        "sent": len(samples),
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "error_kinds": dict(Counter(s.error[:80] for s in samples if s.error)),
        "elapsed_s": round(elapsed, 3),
        "window_s": round(window, 3),
        "rps": round(len(in_window) / window, 2) if window > 0 else 0.0,
        "ttft_without_text": sum(1 for s in ok if s.first is None),
        "mean_chunks": round(sum(len(s.chunk_times) for s in ok) / len(ok), 2) if ok else None,
        "mean_completion_tokens": round(sum(tokens) / len(tokens), 2) if tokens else None,
    }
    for name, values in (("ttft", ttft), ("lat", latency), ("itl", gaps)):
        for q in (50, 90, 95, 99):
            out[f"{name}_ms_p{q}"] = _ms(values, q)
    out["ttft_ms_mean"] = round(sum(ttft) / len(ttft) * 1000, 3) if ttft else None
    out["lat_ms_max"] = round(max(latency) * 1000, 3) if latency else None
    return out


def request_body(spec: LoadSpec, text: str, model: str | None = None) -> dict[str, Any]:
    return {
        "model": model or spec.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **spec.extra,
    }


async def run_load(spec: LoadSpec) -> dict[str, Any]:
    url = chat_url(spec.base_url)
    request_headers = headers(spec.api_key)
    rng = random.Random(spec.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=spec.new_connection)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> Sample:
            body = request_body(spec, prompt(rng, spec.prompt_chars), spec.draw_model(rng))
            return await stream_one(session, url, body, request_headers, spec.timeout_s)

        for _ in range(spec.warmup):
            await one()
        sent = 0
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s

        async def loop() -> None:
            nonlocal sent
            while (sent < spec.requests) if spec.requests else (time.perf_counter() < deadline):
                sent += 1
                samples.append(await one())

        await asyncio.gather(*(loop() for _ in range(spec.concurrency)))
        elapsed = time.perf_counter() - t0
    return summarize(samples, spec, t0, elapsed)


async def first_model(base_url: str, api_key: str | None) -> str:
    base = base_url.rstrip("/")
    url = base + ("/models" if base.endswith("/v1") else "/v1/models")
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, headers=headers(api_key)) as reply,
    ):
        reply.raise_for_status()
        models = (await reply.json())["data"]
    return str(models[0]["id"])


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="with or without the trailing /v1")
    parser.add_argument(
        "--model", help="(default: the first of /v1/models); several, comma-separated: a mix"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("LANEWAY_API_KEY"), help="(default: $LANEWAY_API_KEY)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.bench.load_client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_load_arguments(parser)
    parser.add_argument("--concurrency", type=int, default=1, help="streams at once")
    parser.add_argument("--requests", type=int, default=0, help="send this many (0: --duration)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--warmup", type=int, default=5, help="untimed requests sent first")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt-chars", type=int, default=78)
    parser.add_argument("--new-conn", action="store_true", help="a new connection per request")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--extra", default="{}", help="JSON merged into each request's body")
    parser.add_argument("--label", default="")
    parser.add_argument(
        "--zipf", type=float, default=0.0, help="with several --model: their Zipf exponent"
    )
    args = parser.parse_args(argv)
    model = args.model or asyncio.run(first_model(args.base_url, args.api_key))
    models = tuple(model.split(",")) if "," in model else ()
    spec = LoadSpec(
        base_url=args.base_url,
        model=model,
        api_key=args.api_key,
        concurrency=args.concurrency,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        prompt_chars=args.prompt_chars,
        new_connection=args.new_conn,
        timeout_s=args.timeout,
        seed=args.seed,
        extra=orjson.loads(args.extra),
        label=args.label,
        models=models,
        zipf_s=args.zipf,
    )
    print(orjson.dumps(asyncio.run(run_load(spec))).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
