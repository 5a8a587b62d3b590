"""One request's events as its client gets them, across the workers it runs on.

Token batches are core messages, so one can be lost on its way (a NATS node going, say); the
worker keeps what it published and answers a resend query for it. A request asks when a batch is
missing, when the terminal came before tokens it counts, or when its stream is silent. When its
worker is gone (the planner saw the worker's lease lapse, the worker drained, or it answers
nothing after it had started, or about tokens a finished answer lacks; or no worker took the
request up at all) the request continues on
another worker from the tokens the client has (:mod:`services.ingress.migration`); events of an
attempt it left are dropped from then on.

NATS does not tell a subscriber who published, so a worker's events come on subjects that name
it, which only it may publish to (:mod:`bus.permissions`), and an attempt's events are taken only
from the worker the planner placed that attempt on (``RequestPlaced``, which only the planner
publishes): another worker's credentials cannot end someone else's request or write into its
answer. Events that come before the placement wait for it; events naming no worker are the
planner's own (a request it could not route).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from observability.drops import Drops
from schemas.events import (
    RequestAccepted,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    TerminalEvent,
)
from schemas.messages import ResendReply
from services.ingress.gateway import GatewayEvent
from services.ingress.migration import (
    MIGRATION_LIMIT,
    continued,
    limit_reached,
    unresumable,
    without_worker,
)
from services.ingress.stream_order import StreamOrder, coalesced

# How soon a missing batch is asked for: the stream may go on past it meanwhile.
GAP_WAIT_S = 0.1
# Events kept while an attempt's placement has not come: a few batches race it; past this many
# (anyone may publish under their own name) the oldest go, and a resend asks for them again.
UNPLACED_LIMIT = 256
# What the ingress hears about one request: its worker's events and the planner's.
Heard = GatewayEvent | RequestPlaced

# Any worker may send under its own name for any request: each such event is counted, and
# logged now and then (observability.drops).
log = logging.getLogger(__name__)
_drops = Drops(log)


def _not_placed(event: GatewayEvent, placed: str) -> None:
    _drops(
        "not_placed_worker",
        "dropping a %s of request %s from worker %r: the planner placed it on %r",
        event.type,
        event.request_id,
        event.worker_id,
        placed,
    )


@dataclass(frozen=True, slots=True)
class Recovery:
    completion_wait_s: float = 2.0
    """How long a terminal waits for tokens it counts that nobody answers for, before the request
    goes on from the tokens the client has on another attempt (a failure ends as it is):
    counted from when what was on its way to the ingress as the terminal came has been taken
    in (``Drain``), not from the terminal; an ingress seconds behind its socket still has them
    to read."""
    drain_s: float = 30.0
    """How long that taking in may last before the wait is counted anyway (a connection that
    stopped answering)."""
    silence_s: float = 1.0
    """How long a stream is silent before its worker is asked."""
    orphan_s: float = 6.0
    """How long a started request's worker answers nothing before the request moves on (past
    the workers' lease, after which the planner says so itself)."""
    unplaced_s: float = 4.0
    """How long a request's attempt waits for its placement before the intake is told it is
    late (``unplaced``: its leader asked to step down, bus.leaders); placements take
    milliseconds, and a planner holds one with no worker to give it 2 s at most."""
    unrouted_s: float = 6.0
    """How long no worker holds a request that none answered for yet before it is submitted
    again as the next attempt (its decision or its route was lost on the bus: a durable
    consumer would deliver it again only after 30 s)."""
    migration_limit: int = MIGRATION_LIMIT


class Arrivals(Protocol):
    """What a request's events come through (:class:`services.ingress.mailbox.Mailbox`)."""

    def empty(self) -> bool: ...

    def get_nowait(self) -> Heard: ...

    async def arrival(self, deadline: float) -> bool:
        """Waits for an event, at most until the loop's clock reads ``deadline``; whether one
        came."""
        ...


# (request id, worker asked, first missing token, attempt) → the worker's answer, or None when
# it does not hold the request.
Ask = Callable[[str, str, int, int], Awaitable[ResendReply | None]]
Resubmit = Callable[[RequestAccepted], Awaitable[None]]
# Returns once what was on its way to this ingress when called has come in (or it could not be
# told within ``Recovery.drain_s``): tokens still missing then were lost on the way.
Drain = Callable[[], Awaitable[None]]


class Follow:
    def __init__(
        self,
        accepted: RequestAccepted,
        queue: Arrivals,
        recovery: Recovery,
        ask: Ask,
        resubmit: Resubmit,
        source: str,
        hold: Callable[[float], float] | None = None,
        drain: Drain | None = None,
        unplaced: Callable[[], None] | None = None,
        late: Callable[[str], bool] | None = None,
    ) -> None:
        """``hold``: how long to wait after passing events on before taking the next (seconds;
        what comes meanwhile goes on together), given how long the request has run (seconds),
        e.g. :meth:`LoopLag.hold_s`. ``drain``: what a
        terminal that came before tokens it counts waits for first (none: the wait for them is
        counted from the terminal). ``late``: whether a worker's reports come late (its path
        crawls), so that a silent stream there moves on at once."""
        self._accepted = accepted
        self._late = late
        self._drain = drain
        self._on_unplaced = unplaced
        self._told_unplaced = False  # this attempt's
        self._hold = hold
        self._request_id = accepted.request_id or ""
        self._queue = queue
        self._rec = recovery
        self._ask_holder = ask
        self._resubmit = resubmit
        self._source = source
        self._order = StreamOrder()
        self._loop = asyncio.get_running_loop()
        self.attempt = 0
        self._worker: str | None = None  # this attempt's, once the planner placed it
        self._unplaced: deque[GatewayEvent] = deque(maxlen=UNPLACED_LIMIT)
        self._left: list[str] = []  # the workers earlier attempts were placed on
        now = self._started = self._loop.time()
        self._heard = now  # this attempt's latest sign of life
        self._next_ask = now + recovery.silence_s
        self._held_since: float | None = None
        self._drained = False  # since the terminal was held
        self.ended: TerminalEvent | None = None

    async def events(self) -> AsyncGenerator[GatewayEvent, None]:
        """The request's batches in order, then its terminal event. Batches that came while
        the client was being written to go out together, as one: an ingress that falls behind
        writes fewer, larger chunks instead of working through a backlog of small ones."""
        queue = self._queue
        while self.ended is None:
            if not await queue.arrival(self._next_ask):
                for out in await self._ask():
                    yield out
                continue
            ready = await self._take(queue.get_nowait())
            while self.ended is None and not queue.empty():
                ready.extend(await self._take(queue.get_nowait()))
            for out in coalesced(ready):
                yield out
            if (
                ready
                and self.ended is None
                and self._hold
                and (hold := self._hold(self._loop.time() - self._started)) > 0
            ):
                await asyncio.sleep(hold)

    async def _take(self, event: Heard) -> list[GatewayEvent]:
        if event.attempt != self.attempt:
            return []  # of an attempt the request moved away from
        if isinstance(event, RequestPlaced):
            return await self._placed(event.worker_id)
        if event.worker_id:
            if self._worker is None:
                self._unplaced.append(event)
                return []
            if event.worker_id != self._worker:
                _not_placed(event, self._worker)  # not the worker this attempt runs on
                return []
        if isinstance(event, RequestFailed) and event.code == "worker_lost":
            return await self._migrate("its worker was lost")
        self._heard = self._loop.time()
        return self._pass(event)

    async def _placed(self, worker_id: str) -> list[GatewayEvent]:
        """The attempt's worker is known: take what it sent before, drop what others did."""
        if self._worker is not None:
            # A decision taken again after a planner crash is deduplicated away from the
            # routes stream, so the first placement is the one its worker got.
            return []
        self._worker, self._heard = worker_id, self._loop.time()
        early = []
        for event in self._unplaced:
            if event.worker_id == worker_id:
                early.append(event)
            else:
                _not_placed(event, worker_id)
        self._unplaced.clear()
        ready: list[GatewayEvent] = []
        for event in early:
            if self.ended is not None:
                break
            ready.extend(await self._take(event))
        return ready

    def _pass(self, event: GatewayEvent) -> list[GatewayEvent]:
        ready = list(self._order.take(event))
        for i, out in enumerate(ready):
            if isinstance(out, TerminalEvent):
                self.ended = out
                return ready[: i + 1]
        now = self._loop.time()
        if self._order.held is not None and self._held_since is None:
            self._held_since = now
        if not self._order.gap:
            self._next_ask = now + self._rec.silence_s
        else:
            self._next_ask = min(self._next_ask, now + GAP_WAIT_S)
        return ready

    async def _ask(self) -> list[GatewayEvent]:
        order, worker = self._order, self._worker
        if order.held is not None and not self._drained and self._drain is not None:
            # The missing tokens may still be in this ingress, behind what it has yet to read:
            # they come before the next ask, and the wait for a resend is counted from here.
            self._drained = True
            await self._drain()
            now = self._loop.time()
            self._held_since, self._next_ask = now, now + GAP_WAIT_S
            return []
        if worker is not None and self._late is not None and self._late(worker):
            # What it sends comes seconds late, an answer to an ask as well: a congested link.
            return await self._migrate("its worker's reports come late")
        reply = None
        if worker is not None:
            reply = await self._ask_holder(self._request_id, worker, order.delivered, self.attempt)
        now = self._loop.time()
        if reply is None:
            if self._held_since is not None:
                # Not while arrivals wait to be taken: they may be the missing tokens.
                if now - self._held_since >= self._rec.completion_wait_s and self._queue.empty():
                    return await self._unanswered_gap()
                self._next_ask = now + GAP_WAIT_S
                return []
            bound = self._rec.unrouted_s if self._worker is None else self._rec.orphan_s
            if now - self._heard >= bound:
                silent = "no placement" if self._worker is None else "its worker silent"
                return await self._migrate(f"{silent} for {now - self._heard:.1f} s")
            if self._worker is None and now - self._heard >= self._rec.unplaced_s:
                self._tell_unplaced()
            self._next_ask = now + (GAP_WAIT_S if order.gap else self._rec.silence_s)
            return []
        self._heard = now
        ready: list[GatewayEvent] = []
        for batch in reply.batches:
            if batch.worker_id == worker:
                ready.extend(self._pass(batch))
        if self.ended is None and reply.terminal is not None:
            ready.extend(await self._take(reply.terminal))
            if self.ended is None and reply.complete and order.held is not None:
                # The holder told all it kept, and the tokens the terminal counts are not there.
                ready.extend(self._end(order.give_up(self._source)))
        if self.ended is None:
            self._next_ask = now + (0.0 if not reply.complete else self._rec.silence_s)
        return ready

    async def _unanswered_gap(self) -> list[GatewayEvent]:
        """Tokens the terminal counts never came, and their holder answers no ask for them (a
        link that drops and is too slow to ask across, a holder gone): a finished answer goes
        on from the tokens the client has, on another attempt, as one whose worker is lost; a
        failure or cancellation ends as it was."""
        if isinstance(self._order.held, RequestFinished):
            return await self._migrate("tokens its terminal counts never came")
        return self._end(self._order.give_up(self._source))

    def _tell_unplaced(self) -> None:
        if self._on_unplaced is not None and not self._told_unplaced:
            self._told_unplaced = True
            self._on_unplaced()

    def _end(self, terminal: TerminalEvent) -> list[GatewayEvent]:
        self.ended = terminal
        return [terminal]

    async def _migrate(self, why: str) -> list[GatewayEvent]:
        """Continue the request on another worker from the tokens the client has."""
        order, accepted = self._order, self._accepted
        for end in (without_worker, unresumable):
            done = end(
                accepted.spec, order.delivered, self._request_id, accepted.session_id, self._source
            )
            if done is not None:
                return self._end(done)
        self.attempt += 1
        if self.attempt > self._rec.migration_limit:
            return self._end(
                limit_reached(
                    self._rec.migration_limit,
                    order.delivered,
                    self._request_id,
                    accepted.session_id,
                    self._source,
                )
            )
        # Batches that came past a gap are the new attempt's to send again.
        self._order = StreamOrder()
        self._order.delivered, self._order.token_ids = order.delivered, order.token_ids
        # Rare (a worker or the bus failing), and what an operator replays a slow stream by.
        log.info(
            "request %s, attempt %d on %s: %s; going on from token %d as attempt %d",
            self._request_id,
            self.attempt - 1,
            self._worker or "no worker",
            why,
            order.delivered,
            self.attempt,
        )
        if self._worker is not None:
            self._left.append(self._worker)
        now = self._loop.time()
        self._worker, self._held_since, self._drained = None, None, False
        self._told_unplaced = False
        self._unplaced.clear()
        self._heard, self._next_ask = now, now + self._rec.silence_s
        await self._resubmit(
            accepted.model_copy(
                update={
                    "event_id": f"{accepted.event_id}-{self.attempt}",
                    "spec": continued(accepted.spec, order.token_ids, self.attempt, self._left),
                }
            )
        )
        return []
