"""The chaos suite's load and its tally: closed-loop clients streaming seeded completions, each
stream judged byte for byte against the unfaulted answer for its seed, and per fault one row
of what the clients saw."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.e2e.exact import MAX_TOKENS, SEEDS, Streamed, mismatch, stream_body

# No byte for this long is a hung stream (a SIGSTOPped worker pauses one for 10 s).
READ_TIMEOUT_S = 30.0
# Nor may a whole request take longer.
REQUEST_CAP_S = 90.0
# Every kind of ending a stream can have.
KINDS = ("ok", "failed", "cut", "hung", "lost", "dup")


@dataclass
class Outcome:
    """One request as its client saw it."""

    sent: float
    ended: float
    kind: str  # one of KINDS
    detail: str = ""
    chunks: list[float] = field(default_factory=list)

    def longest_wait_near(self, at: float, window_s: float) -> float:
        """The longest wait (for a first chunk, or between two) that spans ``at`` or begins in
        the ``window_s`` after it."""
        times = [self.sent, *self.chunks]
        return max(
            (b - a for a, b in itertools.pairwise(times) if a <= at + window_s and b >= at),
            default=0.0,
        )


def _events(raw: str) -> list[object]:
    """The complete ``data:`` payloads of an SSE body, even one cut short."""
    out: list[object] = []
    for event in raw.split("\n\n")[:-1]:
        data = event.removeprefix("data: ")
        try:
            out.append(data if data == "[DONE]" else orjson.loads(data))
        except orjson.JSONDecodeError:
            out.append(data)
    return out


@dataclass(frozen=True)
class Load:
    """What the clients ask for. The sim's seeded answers (one byte a token) are exact at any
    length; a real engine's are exact when greedy, and its tokens are not bytes, so every
    request asks for the whole answer (``fixed_length``)."""

    fields: dict[str, Any] = field(default_factory=dict)
    fixed_length: bool = False

    def length(self, rng: random.Random) -> int:
        return MAX_TOKENS if self.fixed_length else rng.randint(1, MAX_TOKENS)

    def expected(self, whole: str, max_tokens: int) -> str:
        return whole if self.fixed_length else whole[:max_tokens]


SIM = Load()


def judge(
    seed: int, max_tokens: int, status: int, raw: str, whole: str, load: Load = SIM
) -> tuple[str, str]:
    """(kind, detail) of one finished request; ``whole``: the seed's unfaulted answer."""
    if status != 200:
        return "failed", f"status {status}: {raw[:200]}"
    events = _events(raw)
    chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
    text = "".join(c.get("text", "") for chunk in chunks for c in chunk["choices"])
    expected = load.expected(whole, max_tokens)
    if not expected.startswith(text):
        kind = "dup" if len(text) > len(expected) else "lost"
        return kind, f"seed {seed}: streamed {text!r}, unstreamed {expected!r}"
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return "failed", orjson.dumps(errors[-1]).decode()[:200]
    if events[-1:] != ["[DONE]"]:
        return "cut", f"seed {seed}: ends {events[-2:]!r}"
    wrong = mismatch(
        Streamed(seed, max_tokens, status, events), whole, byte_tokens=not load.fixed_length
    )
    return ("ok", "") if wrong is None else ("lost", wrong)


async def one_stream(
    http: httpx.AsyncClient, seed: int, max_tokens: int, whole: str, user: str, load: Load = SIM
) -> Outcome:
    """``user``: its session (the planner binds it to a worker in etcd)."""
    sent = time.monotonic()
    chunks: list[float] = []
    raw: list[str] = []
    status = 0

    async def run() -> None:
        nonlocal status
        async with http.stream(
            "POST",
            "/completions",
            json={**stream_body(seed, max_tokens, **load.fields), "user": user},
        ) as response:
            status = response.status_code
            async for text in response.aiter_text():
                chunks.append(time.monotonic())
                raw.append(text)

    try:
        await asyncio.wait_for(run(), REQUEST_CAP_S)
    except (TimeoutError, httpx.TimeoutException) as exc:
        return Outcome(sent, time.monotonic(), "hung", repr(exc), chunks)
    except httpx.HTTPError as exc:
        # A connection refused or reset before an answer began: the client got no clean error.
        kind, _ = judge(seed, max_tokens, status or 200, "".join(raw), whole, load)
        return Outcome(
            sent, time.monotonic(), kind if kind in ("lost", "dup") else "cut", repr(exc), chunks
        )
    kind, detail = judge(seed, max_tokens, status, "".join(raw), whole, load)
    return Outcome(sent, time.monotonic(), kind, detail, chunks)


async def closed_loop(
    http: httpx.AsyncClient,
    whole: dict[int, str],
    clients: int,
    stop: asyncio.Event,
    seed: int,
    load: Load = SIM,
) -> list[Outcome]:
    """``clients`` clients, each sending its next seeded stream as soon as its last one ended,
    until ``stop`` is set; every outcome."""
    outcomes: list[Outcome] = []

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            prompt, n = rng.randrange(SEEDS), load.length(rng)
            outcomes.append(await one_stream(http, prompt, n, whole[prompt], f"client-{i}", load))

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes


async def health_trace(
    probe: Callable[[], Awaitable[bool]], stop: asyncio.Event, every_s: float = 0.5
) -> list[tuple[float, bool]]:
    """(time, ready) every ``every_s`` until ``stop`` is set."""
    seen: list[tuple[float, bool]] = []
    while not stop.is_set():
        seen.append((time.monotonic(), await probe()))
        await asyncio.sleep(every_s)
    return seen


@dataclass
class Row:
    """What one fault did to the load."""

    fault: str
    outcomes: list[Outcome]
    at: float
    health: list[tuple[float, bool]]

    def count(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    @property
    def recover_s(self) -> float | None:
        """From the fault until the last request that did not end ``ok`` ended, and the health
        was ready from then on; None if the health was not ready again by the phase's end."""
        bad = [o.ended for o in self.outcomes if o.kind != "ok"]
        unready = [t for t, ready in self.health if t >= self.at and not ready]
        if self.health and not self.health[-1][1]:
            return None
        return max(0.0, max([*bad, *unready], default=self.at) - self.at)

    def pause_s(self, window_s: float = 5.0) -> float:
        return max((o.longest_wait_near(self.at, window_s) for o in self.outcomes), default=0.0)

    def line(self) -> str:
        n = self.count()
        recover = "never" if self.recover_s is None else f"{self.recover_s:.1f}"
        cells = [f"{len(self.outcomes):>5}", *(f"{n[k]:>7}" for k in KINDS)]
        return f"{self.fault:<20}" + "".join(cells) + f"{self.pause_s():>9.1f}{recover:>10}"


HEADER = (
    f"{'fault':<20}{'sent':>5}"
    + "".join(f"{k:>7}" for k in KINDS)
    + f"{'pause s':>9}"
    + (f"{'recover s':>10}")
)
