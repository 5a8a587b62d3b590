"""Which planner replica may leave the requests' intake (:mod:`services.planner.intake_gate`):
only one while another is registered, and one at a time.

After a host's link heals, the backlog reaches every replica late at once; each judged alone
that its requests came late, and all of them left the intake for ``HOLD_S`` (docs/operations.md,
"Three hosts, the network failing"). So leaving takes a turn: the etcd key ``INTAKE_AWAY_KEY``,
created only where absent, on a lease that outlives the hold a little. The replica that holds it
gives it back when it takes requests again; one that dies meanwhile loses it with its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

import aetcd

from bus.registry import PLANNERS_PREFIX, LeasedKey
from services.planner.intake_gate import HOLD_S

log = logging.getLogger(__name__)

# Each call to etcd is bounded: an unanswered one is no turn (the replica stays).
CALL_TIMEOUT_S = 3.0


class IntakeTurn:
    def __init__(self, etcd: aetcd.Client, instance_id: str) -> None:
        self._etcd = etcd
        self._mine = PLANNERS_PREFIX + instance_id.encode()
        self._key = LeasedKey.intake_away(etcd, instance_id, ttl_s=math.ceil(HOLD_S) + 2)

    async def take(self) -> bool:
        """Whether this replica may leave now: another is registered and none is out. False
        while etcd does not answer (a replica leaves only to others known to take over)."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                if not await self.others():
                    return False
                return await self._key.start_if_absent()
        except Exception:
            log.debug("no turn out of the intake: etcd did not answer", exc_info=True)
            return False

    async def give_back(self) -> None:
        """Taking requests again: another replica may leave now."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._key.stop()

    async def others(self) -> int:
        """How many other planner replicas are registered."""
        found = await self._etcd.get_prefix(PLANNERS_PREFIX, keys_only=True)
        return sum(1 for kv in found if kv.key != self._mine)
