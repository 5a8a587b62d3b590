"""The global prefix index: block hash → workers caching it, as a pure fold of KV events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schemas.events import KvBlocksRemoved, KvBlocksStored, KvCleared, KvEvent


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}

    def apply(self, event: KvEvent) -> None:
        """Fold one event. Applying an event twice leaves the index as applying it once."""
        if isinstance(event, KvBlocksStored):
            self.store(event.worker_id, event.block_hashes)
        elif isinstance(event, KvBlocksRemoved):
            self.remove(event.worker_id, event.block_hashes)
        elif isinstance(event, KvCleared):
            self.remove_worker(event.worker_id)

    def store(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        owned = self._blocks.setdefault(worker_id, set())
        for block in block_hashes:
            owned.add(block)
            self._holders.setdefault(block, set()).add(worker_id)

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        owned = self._blocks.get(worker_id)
        if owned is None:
            return
        for block in block_hashes:
            owned.discard(block)
            self._drop_holder(block, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        for block in self._blocks.pop(worker_id, ()):
            self._drop_holder(block, worker_id)

    def _drop_holder(self, block: int, worker_id: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[block]

    def overlaps(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it caches (0 omitted)."""
        result: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block in enumerate(block_hashes):
            holders = self._holders.get(block)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                result[worker_id] = depth + 1
        return result

    def workers(self) -> set[str]:
        return set(self._blocks)

    def cached(self, worker_id: str) -> frozenset[int]:
        return frozenset(self._blocks.get(worker_id, ()))

    @property
    def size(self) -> int:
        """Distinct (worker, block) pairs."""
        return sum(len(blocks) for blocks in self._blocks.values())
