"""How far behind this process's event loop runs: a timer it sets fires late by as much as the
work queued ahead of it. An ingress whose loop is late reads the bus late too (token batches
pile up in the server's buffer for it, and past its limits the server drops the connection as a
slow consumer), and writes every stream late: it should take no new requests until it catches
up."""

from __future__ import annotations

import asyncio

# Beyond this the ingress counts as behind; well under nats-server's write deadline (10 s),
# and above the lateness of a busy but keeping-up loop (a few tens of milliseconds).
BEHIND_S = 0.5


class LoopLag:
    def __init__(self, interval_s: float = 0.05, behind_s: float = BEHIND_S) -> None:
        self._interval_s = interval_s
        self._behind_s = behind_s
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + interval_s
        self.late_s = 0.0
        """How late the latest tick came (seconds)."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            now = self._loop.time()
            self.late_s = max(0.0, now - self._due)
            self._due = now + self._interval_s

    def behind(self) -> bool:
        """The latest tick came late, or the next one is overdue by now (the loop has not got
        to it yet)."""
        overdue = self._loop.time() - self._due
        return max(self.late_s, overdue) >= self._behind_s
