"""The kv-indexer's subscribers: fold KV events, answer overlap queries, purge dead workers."""

from __future__ import annotations

from schemas.events import Event, KvBlocksRemoved, KvBlocksStored, KvCleared
from schemas.messages import OverlapQuery, OverlapReply, WorkerRegistration
from services.kv_indexer.index import PrefixIndex


class Indexer:
    def __init__(self) -> None:
        self.index = PrefixIndex()
        # Workers whose lease is live. Replay brings back events of workers long gone; they are
        # folded (the fold stays pure) but never offered to the planner, and purged once known.
        self._live: set[str] = set()
        self._seen_live = False

    async def on_kv(self, event: Event) -> None:
        if isinstance(event, KvBlocksStored | KvBlocksRemoved | KvCleared):
            self.index.apply(event)

    async def on_query(self, query: OverlapQuery) -> OverlapReply:
        overlaps = self.index.overlaps(query.block_hashes)
        if self._seen_live:
            overlaps = {w: n for w, n in overlaps.items() if w in self._live}
        return OverlapReply(overlaps=overlaps, indexed_blocks=self.index.size)

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        gone = self._live - workers.keys()
        self._live = set(workers)
        self._seen_live = True
        for worker_id in gone:
            self.index.remove_worker(worker_id)

    def purge_unknown(self) -> None:
        """Drop workers that hold blocks but have no live lease (replayed history)."""
        if self._seen_live:
            for worker_id in self.index.workers() - self._live:
                self.index.remove_worker(worker_id)
