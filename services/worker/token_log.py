"""What a worker published for each of its requests, kept so that a batch lost on its way to the
ingress (token deltas are core messages) can be sent again. Pure: the caller gives the time.

A request's batches are kept while it runs and for ``keep_s`` after it ended; ended requests are
also let go, oldest first, once the kept batches pass ``max_bytes``. A running request is never
let go, so a holder that answers has every batch of it; its own size is bounded by its
``max_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from schemas.events import TerminalEvent, TokenRun, TokensGenerated
from schemas.messages import ResendReply

# A reply stays well under the bus's smallest usual max_payload (1 MiB); the asker asks again.
REPLY_BYTES = 512 * 1024


def _size(token_ids: int, text: str) -> int:
    # JSON of an id list and a text: about this many bytes; the bound need not be exact.
    return 8 * token_ids + len(text.encode()) + 256


@dataclass(slots=True)
class _Kept:
    """A request's published runs as columns, not one object each: a worker holds hundreds of
    thousands of runs of its running requests, and a run kept as a model (two objects the
    garbage collector traverses) made each of its young collections take up to 2 s with 500
    streams of 2,000 tokens (`make probe-streams`), stalling every stream of the worker."""

    token_ids: list[int] = field(default_factory=list)  # every run's, one after the other
    starts: list[int] = field(default_factory=list)  # where each run's are in token_ids
    indexes: list[int] = field(default_factory=list)  # each run's first token's index
    texts: list[str] = field(default_factory=list)
    size: int = 0
    terminal: TerminalEvent | None = None
    ended_at: float = 0.0
    attempt: int = 0

    def runs(self) -> Iterator[tuple[int, tuple[int, ...], str]]:
        """Each kept run: its index, token ids and text."""
        if not self.starts:
            return
        ends = [*self.starts[1:], len(self.token_ids)]
        columns = zip(self.starts, ends, self.indexes, self.texts, strict=True)
        for start, end, index, text in columns:
            yield index, tuple(self.token_ids[start:end]), text


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
        if kept is None or run.attempt != kept.attempt:  # not of the attempt held here
            return
        kept.starts.append(len(kept.token_ids))
        kept.token_ids.extend(run.token_ids)
        kept.indexes.append(run.index)
        kept.texts.append(run.text)
        size = _size(len(run.token_ids), run.text)
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
        for run_index, token_ids, text in kept.runs():
            if run_index + len(token_ids) <= index:
                continue
            budget -= _size(len(token_ids), text)
            if budget < 0 and batches:
                return ResendReply(batches=tuple(batches), complete=False)
            batches.append(
                TokensGenerated(
                    source=self._source,
                    request_id=request_id,
                    worker_id=self._worker_id,
                    index=run_index,
                    token_ids=token_ids,
                    text=text,
                    attempt=kept.attempt,
                )
            )
        return ResendReply(batches=tuple(batches), terminal=kept.terminal)

    def _drop(self, request_id: str) -> None:
        kept = self._running.pop(request_id, None) or self._ended.pop(request_id, None)
        if kept is not None:
            self._bytes -= kept.size
