"""How many NATS messages (and bytes) a live request costs, by kind of subject: a subscriber to
every subject (`>`, as the cluster's admin) counts them for a few seconds under load.

Subjects are grouped with their ids masked (``lw.tok.<ingress>.<worker>`` → ``lw.tok.*.*``;
inbox replies and JetStream acknowledgements by their first tokens), so that each group is one
kind of hop. A message a JetStream consumer pulls is seen a second time, delivered under its
stored subject (``lw.req.accepted`` and ``lw.route.*`` show two a request, published once).
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import nats

from bus.topology import Subjects

# An id in a subject: long, or holding a digit (worker-0, a uuid's hex, an inbox's counter).
_ID = re.compile(r"^(?=.*\d).+$|^.{20,}$")
_PREFIXES = {"_INBOX": 1, "$JS": 3}
# A request's terminal event, once per finished request: what "per request" counts.
TERMINALS = Subjects.request_terminal().subject


def subject_kind(subject: str) -> str:
    tokens = subject.split(".")
    keep = _PREFIXES.get(tokens[0])
    if keep is not None:
        return ".".join(tokens[:keep] + (["*"] if len(tokens) > keep else []))
    return ".".join("*" if _ID.match(t) else t for t in tokens)


def matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one of ``pattern``'s (NATS ``*`` wildcards only)."""
    want, got = pattern.split("."), subject.split(".")
    return len(want) == len(got) and all(w in ("*", g) for w, g in zip(want, got, strict=True))


async def _listen(nats_url: str, subject: str, seconds: float, on_msg: Any) -> None:
    connection = await nats.connect(nats_url, name="laneway-bench-census")
    try:
        await connection.subscribe(subject, cb=on_msg, pending_msgs_limit=1_000_000)
        await asyncio.sleep(seconds)
    finally:
        await connection.close()


async def finished(nats_url: str, seconds: float) -> int:
    """Requests finished over ``seconds``, by their terminal events (one subscriber more to
    those alone: the bus's load barely changes)."""
    seen = 0

    async def on_msg(msg: Any) -> None:
        nonlocal seen
        seen += 1

    await _listen(nats_url, TERMINALS, seconds, on_msg)
    return seen


async def census(nats_url: str, seconds: float) -> tuple[dict[str, dict[str, int]], int]:
    """Messages and bytes per kind of subject over ``seconds`` of the bus, and the requests
    finished meanwhile."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    terminals = 0

    async def on_msg(msg: Any) -> None:
        nonlocal terminals
        kind = subject_kind(msg.subject)
        counts[kind] += 1
        sizes[kind] += len(msg.data)
        terminals += matches(TERMINALS, msg.subject)

    await _listen(nats_url, ">", seconds, on_msg)
    return {k: {"messages": n, "bytes": sizes[k]} for k, n in counts.most_common()}, terminals


def per_request(kinds: dict[str, dict[str, int]], requests: float) -> list[dict[str, Any]]:
    rows = [
        {
            "subject": kind,
            "messages_per_request": round(c["messages"] / requests, 2),
            "bytes_per_message": round(c["bytes"] / c["messages"]),
        }
        for kind, c in kinds.items()
    ]
    total = sum(c["messages"] for c in kinds.values())
    rows.append({"subject": "all", "messages_per_request": round(total / requests, 2)})
    return rows
