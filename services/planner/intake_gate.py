"""Whether a planner replica takes requests from the intake its replicas share, pure.

Replicas take requests from one durable (``PLANNER_INTAKE``), the server handing each to one
of them. A replica behind a slow link gets its share seconds late, and its routes go out as
late (docs/operations.md, "Three hosts, the network failing": the second planner, on the host
slowed to 512 kbit/s, took half the requests and confirmed their routes 3 to 7 s later). So a
replica whose requests all come ``LATE_S`` later than usual (:class:`Delays`, the rule the
workers' load reports are judged by) leaves the intake to the others, when there are others and
no other is out (:mod:`services.planner.intake_turn`); after ``HOLD_S`` it takes requests again,
and leaves again at the first that comes late.

If every replica's requests come late, the slow link is the intake's own (its leader's host):
then they all leave for ``HOLD_S`` at worst, while the ingress has that leader step down.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.liveness import RECENT_S, USUAL_S, Delays

HOLD_S = 5.0


class IntakeGate:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self._clock = clock
        self._wall = wall
        # Per ingress: each has its own clock, whose offset its usual delay holds.
        self._delays: dict[str, Delays] = {}
        self._left_at: float | None = None

    @property
    def taking(self) -> bool:
        return self._left_at is None

    def heard(self, ingress: str, sent_at: float) -> None:
        """A request came from ``ingress``, which accepted it at ``sent_at`` on its wall clock
        (seconds since the epoch)."""
        now = self._clock()
        delays = self._delays.get(ingress)
        if delays is None:
            # Ingresses come and go: one not heard from for USUAL_S has no usual left.
            self._delays = {i: d for i, d in self._delays.items() if d.newest >= now - USUAL_S}
            delays = self._delays[ingress] = Delays()
        delays.add(now, self._wall() - sent_at)

    def late(self) -> bool:
        """The requests of the last moment, from every ingress that sent one, all came late."""
        now = self._clock()
        recent = [d for d in self._delays.values() if d.newest >= now - RECENT_S]
        return bool(recent) and all(d.late(now) for d in recent)

    def leave(self) -> None:
        """Left the intake now (its requests came late, and it was this replica's turn)."""
        self._left_at = self._clock()

    def back(self) -> bool:
        """Whether to take requests again now, having left ``HOLD_S`` ago."""
        if self._left_at is None or self._clock() < self._left_at + HOLD_S:
            return False
        self._left_at = None
        return True
