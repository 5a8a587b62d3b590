"""What a worker published for each of its requests, kept so that a batch lost on its way to the
ingress (token deltas are core messages) can be sent again. Pure: the caller gives the time.

A request's batches are kept while it runs and for ``keep_s`` after it ended; ended requests are
also let go, oldest first, once the kept batches pass ``max_bytes``. A running request is never
let go, so a holder that answers has every batch of it; its own size is bounded by its
``max_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from schemas.events import TerminalEvent, TokenRun, TokensGenerated
from schemas.messages import ResendReply

# A reply stays well under the bus's smallest usual max_payload (1 MiB); the asker asks again.
REPLY_BYTES = 512 * 1024


def _size(run: TokenRun) -> int:
    # JSON of an id list and a text: about this many bytes; the bound need not be exact.
    return 8 * len(run.token_ids) + len(run.text.encode()) + 256


@dataclass(slots=True)
class _Kept:
    batches: list[TokenRun] = field(default_factory=list)
    size: int = 0
    terminal: TerminalEvent | None = None
    ended_at: float = 0.0
    attempt: int = 0


class TokenLog:
    """``source`` and ``worker_id``: the publisher's, as the resent batches name it."""

    def __init__(
        self, source: str, worker_id: str, keep_s: float = 30.0, max_bytes: int = 64 << 20
    ) -> None:
        self._source = source
        self._worker_id = worker_id
        self._keep_s = keep_s
        self._max_bytes = max_bytes
        self._bytes = 0
        self._running: dict[str, _Kept] = {}
        # Ended requests, in the order they ended.
        self._ended: OrderedDict[str, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)

    def started(self, request_id: str, attempt: int = 0) -> None:
        """The worker holds ``attempt`` of ``request_id`` (no batch yet): resend queries for it
        are answered."""
        if request_id not in self._running:
            self._drop(request_id)
            self._running[request_id] = _Kept(attempt=attempt)

    def published(self, run: TokenRun) -> None:
        kept = self._running.get(run.request_id)
        if kept is None:
            return
        size = _size(run)
        kept.batches.append(run)
        kept.size += size
        self._bytes += size

    def ended(self, terminal: TerminalEvent, now: float) -> None:
        kept = self._running.pop(terminal.request_id or "", None)
        if kept is None:
            return
        kept.terminal, kept.ended_at = terminal, now
        self._ended[terminal.request_id or ""] = kept
        self.expire(now)

    def forget(self, request_id: str) -> None:
        """Let go of a request that another attempt of replaces here."""
        self._drop(request_id)

    def expire(self, now: float) -> None:
        while self._ended:
            request_id, kept = next(iter(self._ended.items()))
            if now - kept.ended_at < self._keep_s and self._bytes <= self._max_bytes:
                break
            self._drop(request_id)

    def attempt(self, request_id: str) -> int | None:
        """The attempt of ``request_id`` kept here (running or ended), if any."""
        kept = self._running.get(request_id) or self._ended.get(request_id)
        return None if kept is None else kept.attempt

    def reply(self, request_id: str, index: int, attempt: int = 0) -> ResendReply | None:
        """The batches of the request's ``attempt`` from token ``index`` on (and the terminal,
        once ended); None: that attempt is not held here."""
        kept = self._running.get(request_id) or self._ended.get(request_id)
        if kept is None or kept.attempt != attempt:
            return None
        batches: list[TokensGenerated] = []
        budget = REPLY_BYTES
        for batch in kept.batches:
            if batch.index + len(batch.token_ids) <= index:
                continue
            budget -= _size(batch)
            if budget < 0 and batches:
                return ResendReply(batches=tuple(batches), complete=False)
            batches.append(self._delta(batch))
        return ResendReply(batches=tuple(batches), terminal=kept.terminal)

    def _delta(self, run: TokenRun) -> TokensGenerated:
        return TokensGenerated(
            source=self._source,
            request_id=run.request_id,
            worker_id=self._worker_id,
            index=run.index,
            token_ids=run.token_ids,
            text=run.text,
            attempt=run.attempt,
        )

    def _drop(self, request_id: str) -> None:
        kept = self._running.pop(request_id, None) or self._ended.pop(request_id, None)
        if kept is not None:
            self._bytes -= kept.size
