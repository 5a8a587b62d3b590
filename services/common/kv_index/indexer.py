"""The kv-indexer's subscribers: fold KV events, answer overlap queries, purge dead workers."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import xxhash
from opentelemetry import trace

from observability.drops import Drops
from schemas.events import BlockHashes, KvEvent, RouteDecided
from schemas.messages import (
    IndexState,
    IndexStateQuery,
    OverlapQueries,
    OverlapQuery,
    OverlapReplies,
    OverlapReply,
    WorkerRegistration,
)
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.metrics import IndexerMetrics
from services.common.kv_index.predicted import PredictedCache

log = logging.getLogger(__name__)
_drops = Drops(log)


class Indexer:
    def __init__(
        self,
        index: PrefixIndex,
        predicted_ttl_s: float = 300.0,
        follow_routes: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """``follow_routes(worker_id)``: from now on, hand :meth:`on_route` the decisions routed
        to that worker (or prefilled there); called once per worker whose cache is predicted.
        Workers with KV events are not followed: a decision is the largest event of a
        request, and for them nothing in it is needed."""
        self._follow_routes = follow_routes
        self._followed: set[str] = set()
        self.index = index
        self.restored_from = index.position
        self.snapshotted_at = index.position
        # Workers whose engines publish no KV events: their caches are predicted from routing.
        self.predicted = PredictedCache(predicted_ttl_s)
        # Workers whose lease is live. Replay brings back events of workers long gone; they are
        # folded (the fold stays pure) but never offered to the planner, and purged once known.
        self._live: set[str] = set()
        self._seen_live = False
        self._tracer = trace.get_tracer("laneway.kv_indexer")
        # KV events that could not be true, dropped unfolded.
        self.implausible = 0
        self.metrics = IndexerMetrics(lambda: self.index)

    async def on_kv(self, event: KvEvent, position: int) -> None:
        # Each of a worker's events takes a position of the KV stream, so its seq cannot pass
        # the position it lands at: a larger one would park the worker's cursor past every real
        # event to come (one forged seq=10**15 froze a worker's index).
        if event.seq > position:
            self.implausible += 1
            _drops(
                "implausible_seq",
                "dropping a %s of worker %r: seq %d past stream position %d",
                event.type,
                event.worker_id[:64],
                event.seq,
                position,
            )
            return
        self.index.apply(event)
        self.index.position = position
        self.metrics.events.inc()

    async def on_route(self, event: RouteDecided) -> None:
        now = time.monotonic()
        self.predicted.routed(event.worker_id, event.spec.block_hashes, now)
        # A remote prefill caches the prompt on the prefill worker too.
        remote = event.prefill.prefill_worker_id if event.prefill is not None else None
        if remote is not None:
            self.predicted.routed(remote, event.spec.block_hashes, now)

    async def on_query(self, query: OverlapQuery) -> OverlapReply:
        # A child of the asking planner's route span (the query's headers carry its trace).
        with (
            self.metrics.query_seconds.time(),
            self._tracer.start_as_current_span("kv_indexer.overlap") as span,
        ):
            reply = self._answer(query, time.monotonic())
            span.set_attribute("laneway.query_blocks", len(query.block_hashes))
            span.set_attribute("laneway.best_overlap", max(reply.overlaps.values(), default=0))
            span.set_attribute("laneway.workers_overlapping", len(reply.overlaps))
            return reply

    async def on_queries(self, batch: OverlapQueries) -> OverlapReplies:
        # A child of the route span of the batch's first request (the headers carry its trace).
        with (
            self.metrics.query_seconds.time(),
            self._tracer.start_as_current_span("kv_indexer.overlaps") as span,
        ):
            now = time.monotonic()
            span.set_attribute("laneway.queries", len(batch.queries))
            span.set_attribute(
                "laneway.query_blocks", sum(len(q.block_hashes) for q in batch.queries)
            )
            return OverlapReplies(replies=tuple(self._answer(q, now) for q in batch.queries))

    def _answer(self, query: OverlapQuery, now: float) -> OverlapReply:
        overlaps, host_runs = self.overlaps(query.block_hashes, now)
        return OverlapReply(overlaps=overlaps, indexed_blocks=self.index.size, host_runs=host_runs)

    def overlaps(
        self, block_hashes: BlockHashes, now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per live worker, the prompt's leading blocks it caches on its GPU (known or
        predicted), and how many more its host tier holds after them."""
        overlaps = self.index.overlaps(block_hashes)
        for worker_id, depth in self.predicted.overlaps(block_hashes, now).items():
            overlaps[worker_id] = max(depth, overlaps.get(worker_id, 0))
        host_runs = self.index.host_runs(block_hashes, overlaps)
        if self._seen_live:
            overlaps = {w: n for w, n in overlaps.items() if w in self._live}
            host_runs = {w: n for w, n in host_runs.items() if w in self._live}
        return overlaps, host_runs

    async def on_state(self, query: IndexStateQuery) -> IndexState:
        pairs = sorted(
            (worker_id, block)
            for worker_id in self.index.workers()
            for block in self.index.cached(worker_id)
        )
        digest = xxhash.xxh3_128_hexdigest(repr(pairs).encode())
        index = self.index
        return IndexState(
            indexed_blocks=index.size,
            digest=digest,
            position=index.position,
            restored_from=self.restored_from,
            blocks_per_worker={w: index.blocks_of(w) for w in index.workers()},
            duplicates=index.duplicates,
            gaps=index.gaps,
        )

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        gone = self._live - workers.keys()
        self._live = set(workers)
        self._seen_live = True
        for worker_id in gone:
            self.index.remove_worker(worker_id)
            self.predicted.forget(worker_id)
        for worker_id, reg in workers.items():
            if not reg.kv_events and not self.predicted.tracks(worker_id):
                self.predicted.track(worker_id, reg.kv_blocks_total)
            if not reg.kv_events and worker_id not in self._followed:
                self._followed.add(worker_id)  # one subscription, should it leave and come back
                if self._follow_routes is not None:
                    await self._follow_routes(worker_id)

    def purge_unknown(self) -> None:
        """Drop workers that hold blocks but have no live lease (replayed history)."""
        if self._seen_live:
            for worker_id in self.index.workers() - self._live:
                self.index.remove_worker(worker_id)
