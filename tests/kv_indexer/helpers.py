"""Helpers of the kv-indexer's live tests."""

from __future__ import annotations

from bus.client import Bus
from bus.topology import Subjects
from schemas.messages import IndexState, IndexStateQuery


async def index_state(bus: Bus, instance: str) -> IndexState:
    """One kv-indexer replica's digest of its index."""
    return await bus.request(Subjects.index_state(instance), IndexStateQuery(), timeout=5)
