"""One request's events put back in the order its worker published them, pure.

Token batches and the terminal event reach the ingress on two subscriptions, each drained by a
task of its own, so a terminal can arrive before the last batches, and batches before earlier
ones. Every batch carries the index of its first token and every terminal the number of tokens
published before it, so the order is restored here: batches go out by index (a repeated index is
dropped), and a terminal is held until every token it counts has gone out before it.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.events import RequestFailed, RequestFinished, TerminalEvent, TokensGenerated
from services.ingress.gateway import GatewayEvent


def tokens_before(terminal: TerminalEvent) -> int:
    """How many tokens the request's worker published before ``terminal``."""
    if isinstance(terminal, RequestFinished):
        return terminal.usage.completion_tokens
    return terminal.completion_tokens


def coalesced(events: list[GatewayEvent]) -> list[GatewayEvent]:
    """``events`` (in order, as :class:`StreamOrder` gives them) with each run of consecutive
    batches joined into one."""
    if len(events) < 2:
        return events
    out: list[GatewayEvent] = []
    run: list[TokensGenerated] = []
    for event in [*events, None]:
        if isinstance(event, TokensGenerated):
            run.append(event)
            continue
        if len(run) > 1:
            out.append(_joined(run))
        else:
            out.extend(run)
        run = []
        if event is not None:
            out.append(event)
    return out


def _joined(batches: list[TokensGenerated]) -> TokensGenerated:
    return batches[0].model_copy(
        update={
            "token_ids": tuple(i for batch in batches for i in batch.token_ids),
            "text": "".join(batch.text for batch in batches),
            "logprobs": tuple(p for batch in batches for p in batch.logprobs),
        }
    )


class StreamOrder:
    __slots__ = ("_early", "delivered", "held", "token_ids")

    def __init__(self) -> None:
        self.delivered = 0
        """Tokens passed on so far: the index the next batch to go out starts at."""
        self.token_ids: list[int] = []
        """The tokens passed on so far (what a continuation on another worker starts from)."""
        self._early: dict[int, TokensGenerated] = {}
        self.held: TerminalEvent | None = None
        """The terminal event, while tokens it counts are still missing."""

    def take(self, event: GatewayEvent) -> Sequence[GatewayEvent]:
        """The events that can go to the client now that ``event`` arrived, in order."""
        if isinstance(event, TokensGenerated):
            if event.index != self.delivered:
                if event.index > self.delivered:
                    self._early.setdefault(event.index, event)
                return ()
            self._pass(event)
            if not self._early and self.held is None:
                return (event,)  # the usual case: in order, nothing waiting on it
            ready: list[GatewayEvent] = [event]
            while (following := self._early.pop(self.delivered, None)) is not None:
                ready.append(following)
                self._pass(following)
            for stale in [index for index in self._early if index < self.delivered]:
                del self._early[stale]  # a copy of a batch that went out (a resend's)
            if self.held is not None and self.delivered >= tokens_before(self.held):
                ready.append(self.held)
            return ready
        if self.held is not None:
            return ()  # the first terminal decides how the request ends
        if self.delivered < tokens_before(event):
            self.held = event
            return ()
        return (event,)

    @property
    def gap(self) -> bool:
        """A later batch came while an earlier one is missing (or the terminal did)."""
        return bool(self._early) or self.held is not None

    def _pass(self, batch: TokensGenerated) -> None:
        self.delivered += len(batch.token_ids)
        self.token_ids.extend(batch.token_ids)

    def give_up(self, source: str) -> TerminalEvent:
        """How the held request ends when its missing tokens will not come: a failure stays
        what it was; an answer with a gap becomes an error, never a silently shorter answer."""
        held = self.held
        assert held is not None
        if not isinstance(held, RequestFinished):
            return held
        return RequestFailed(
            source=source,
            request_id=held.request_id,
            session_id=held.session_id,
            trace=held.trace,
            worker_id=held.worker_id,
            code="incomplete_stream",
            message=f"tokens {self.delivered}–{tokens_before(held) - 1} of the answer were lost "
            "on their way from the worker: the answer is incomplete, retry the request",
            completion_tokens=self.delivered,
        )
