"""The planner's routing decisions as the migration tests follow them: where requests went
lately (to pick a worker to fault) and which were migrated."""

from __future__ import annotations

import time
from collections import Counter

from bus.client import Bus
from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import Event, RouteDecided
from schemas.messages import WorkerRegistration
from tests.helpers import eventually


class Moves:
    """The migrated routing decisions the planner records, and where requests went lately."""

    def __init__(self) -> None:
        self.routes: list[RouteDecided] = []
        self._placed: list[tuple[float, str]] = []

    async def on_event(self, event: Event) -> None:
        if isinstance(event, RouteDecided):
            self._placed.append((time.monotonic(), event.worker_id))
            if event.reason.startswith("migrated"):
                self.routes.append(event)

    def serving(self, within_s: float = 1.0, most: bool = False) -> str | None:
        """Of the workers given requests in the last ``within_s`` (the streams under way: the
        unstreamed answers before them took seconds), the one given fewest: a fault on it meets
        some streams, and the others go on elsewhere. ``most``: the one given most, whose
        streams are surely still running a moment later (a fast engine ends one stream's
        answer in half a second)."""
        since = time.monotonic() - within_s
        placed = Counter(worker for at, worker in self._placed if at >= since)
        pick = max if most else min
        return pick(placed, key=lambda w: (placed[w], w)) if placed else None

    async def victim(
        self, workers: dict[str, WorkerRegistration], most: bool = False
    ) -> WorkerRegistration:
        return workers[await eventually(lambda: self.serving(most=most), timeout=10)]


async def observe_moves(cluster: LocalCluster) -> tuple[Bus, Moves]:
    bus = await Bus.connect(cluster.nats_url, "test-moves")
    moves = Moves()
    await bus.subscribe(Subjects.route_decisions, moves.on_event)
    return bus, moves
