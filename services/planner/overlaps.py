"""Where the planner's overlap answers come from: its own fold of the KV stream where it keeps
one and that has caught up, else the kv-indexer, the queries of one turn of its event loop asked
in one round trip.

Requests come to the planner in bursts (a JetStream delivery brings several, each routed in a
task of its own): at 32 concurrent streams a query had 7 others in its turn on average, at 128
about 20. Asked one by one, each cost a request and a reply on the bus, and their encoding, on
the planner, the server and the indexer. The batch goes out at the end of the turn its first
query was asked in, so a lone query waits for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import BlockHashes
from schemas.messages import OVERLAP_BATCH_LIMIT, OverlapQueries, OverlapQuery
from services.common.kv_follow import KvFollower

log = logging.getLogger(__name__)

# Per worker, the prompt's leading blocks it caches on its GPU; and how many more its host tier
# holds after them.
Overlap = tuple[dict[str, int], dict[str, int]]
_NONE: Overlap = ({}, {})


class OverlapAsker:
    def __init__(self, bus: Bus, timeout_s: float, seconds: Histogram, failures: Counter) -> None:
        """``seconds`` observes each batch's round trip; ``failures`` counts the queries whose
        batch went unanswered in time (those requests are routed on load alone)."""
        self._bus = bus
        self._timeout_s = timeout_s
        self._seconds = seconds
        self._failures = failures
        self._queued: list[tuple[BlockHashes, asyncio.Future[Overlap]]] = []
        self._asking: set[asyncio.Task[None]] = set()

    async def ask(self, block_hashes: BlockHashes) -> Overlap:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Overlap] = loop.create_future()
        if not self._queued:
            loop.call_soon(self._send)
        self._queued.append((block_hashes, answer))
        return await answer

    def _send(self) -> None:
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), OVERLAP_BATCH_LIMIT):
            task = asyncio.create_task(self._ask(queued[start : start + OVERLAP_BATCH_LIMIT]))
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)

    async def _ask(self, batch: list[tuple[BlockHashes, asyncio.Future[Overlap]]]) -> None:
        started = time.monotonic()
        query = OverlapQueries(queries=tuple(OverlapQuery(block_hashes=b) for b, _ in batch))
        try:
            reply = await self._bus.request(
                Subjects.overlap_queries, query, timeout=self._timeout_s
            )
            if len(reply.replies) != len(batch):
                raise ValueError(f"{len(reply.replies)} answers to {len(batch)} queries")
            answers = [(r.overlaps, r.host_runs) for r in reply.replies]
        except Exception as error:  # no indexer, too slow, or nonsense: route on load alone
            elapsed = time.monotonic() - started
            self._failures.inc(len(batch))
            log.warning(
                "%d overlap queries failed after %.1f ms: %r", len(batch), elapsed * 1e3, error
            )
            answers = [_NONE] * len(batch)
        self._seconds.observe(time.monotonic() - started)
        for (_, future), answer in zip(batch, answers, strict=True):
            if not future.done():  # its request may have been cancelled meanwhile
                future.set_result(answer)


class Overlaps:
    """The answer from ``follower``'s fold while it is current, else the indexer's.

    A fold that has not caught up with the stream (restoring and replaying at start, after a
    reconnect, or lagging a burst) would answer from the past: a prefix cached since looks
    uncached, one evicted since looks cached. The indexer's fold has kept up meanwhile (or is
    in the same place, and then the answer is no worse), so it is asked instead."""

    def __init__(self, asker: OverlapAsker, follower: KvFollower | None, answers: Counter) -> None:
        """``answers`` counts them by where they came from (label ``local`` or ``indexer``)."""
        self._asker = asker
        self._follower = follower
        self._local = answers.labels("local")
        self._asked = answers.labels("indexer")

    async def ask(self, block_hashes: BlockHashes) -> Overlap:
        follower = self._follower
        span = trace.get_current_span()
        if follower is not None and follower.current():
            self._local.inc()
            span.set_attribute("laneway.overlap_source", "local")
            return follower.indexer.overlaps(block_hashes, time.monotonic())
        self._asked.inc()
        span.set_attribute("laneway.overlap_source", "indexer")
        return await self._asker.ask(block_hashes)
