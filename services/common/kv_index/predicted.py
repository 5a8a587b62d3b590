"""Approximate mode: for workers whose engine publishes no KV events, predict their cache from
where the planner sent each prompt. A routed prompt's blocks are assumed cached there until they
expire or the worker's capacity pushes them out, least recently routed first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PredictedCache:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        # Per worker: block hash → expiry time, least recently routed first.
        self._blocks: dict[str, OrderedDict[int, float]] = {}
        self._capacity: dict[str, int] = {}

    def track(self, worker_id: str, capacity_blocks: int) -> None:
        """Predict this worker's cache from now on (it registered without KV events)."""
        self._blocks.setdefault(worker_id, OrderedDict())
        self._capacity[worker_id] = capacity_blocks

    def tracks(self, worker_id: str) -> bool:
        return worker_id in self._blocks

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def routed(self, worker_id: str, block_hashes: Sequence[int], now: float) -> None:
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            return
        expiry = now + self._ttl_s
        for block in block_hashes:
            blocks[block] = expiry
            blocks.move_to_end(block)
        self._expire(worker_id, now)

    def _expire(self, worker_id: str, now: float) -> None:
        blocks = self._blocks[worker_id]
        capacity = self._capacity[worker_id]
        while blocks:
            block, expiry = next(iter(blocks.items()))
            if expiry > now and len(blocks) <= capacity:
                break
            del blocks[block]

    def overlaps(self, block_hashes: Sequence[int], now: float) -> dict[str, int]:
        result = {}
        for worker_id, blocks in self._blocks.items():
            depth = 0
            for block in block_hashes:
                expiry = blocks.get(block)
                if expiry is None or expiry <= now:
                    break
                depth += 1
            if depth:
                result[worker_id] = depth
        return result
