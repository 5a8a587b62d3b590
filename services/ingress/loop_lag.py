"""How far behind this process's event loop runs: a timer it sets fires late by as much as the
work queued ahead of it. An ingress whose loop stays late reads the bus late too (token batches
pile up in the server's buffer for it, and past its limits the server drops the connection as a
slow consumer), and writes every stream late: it should take no new requests until it catches
up.

Only lateness that lasts counts: on a shared machine one turn of the loop now and then runs long
(the process descheduled, a collection, a burst of requests handled in one turn) and the loop
catches up at the next; refusing requests for that sheds ordinary load. The loop is behind once
``streak`` ticks in a row came late (the tick now overdue counts as one): for a slow consumer
the server must be kept waiting for seconds (its write deadline is 10 s), so two long turns in a
row are still early enough to push back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Beyond this a tick counts as late; well under nats-server's write deadline (10 s), and above
# the lateness of a busy but keeping-up loop (a few tens of milliseconds).
BEHIND_S = 0.5
# Late ticks in a row that make the loop behind.
STREAK = 2
# A loop whose ticks come this late, STREAK in a row, is busy: each stream that has run
# ``HOLD_AFTER_S`` is then written less often (``hold_s``), well before the loop is behind. Every
# new request's way through the ingress (its HTTP request, its first tokens) waits about this
# long per turn of the loop: at 0.2 s, 2,000 long streams kept the loop 85-100 ms late, under
# the bar, and a new request's first token took up to 1.1 s.
BUSY_S = 0.05
# A stream is held only once it has run this long: a request's first tokens, and all of a short
# answer's, go out as they come however busy the loop.
HOLD_AFTER_S = 1.0
# The longest a stream's tokens are held back for a busy loop: under the silence after which a
# stream's worker is asked (``Recovery.silence_s``, 1 s).
MAX_HOLD_S = 0.8


class LoopLag:
    def __init__(
        self,
        interval_s: float = 0.05,
        behind_s: float = BEHIND_S,
        streak: int = STREAK,
        on_tick: Callable[[float], None] | None = None,
    ) -> None:
        """``on_tick``: hears each tick's lateness (seconds), e.g. a histogram's ``observe``."""
        if streak < 1:
            raise ValueError("streak must be at least 1")
        self._interval_s = interval_s
        self._behind_s = behind_s
        self._streak = streak
        self._on_tick = on_tick
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + interval_s
        self.late_s = 0.0
        """How late the latest tick came (seconds)."""
        self.late_ticks = 0
        """Ticks in a row, up to the latest, that came late by ``behind_s`` or more."""
        self.busy_ticks = 0
        """Ticks in a row, up to the latest, that came late by ``BUSY_S`` or more."""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            now = self._loop.time()
            self.late_s = max(0.0, now - self._due)
            self.late_ticks = self.late_ticks + 1 if self.late_s >= self._behind_s else 0
            self.busy_ticks = self.busy_ticks + 1 if self.late_s >= BUSY_S else 0
            self._due = now + self._interval_s
            if self._on_tick is not None:
                self._on_tick(self.late_s)

    def behind(self) -> bool:
        """The latest ``streak`` ticks came late, the one overdue by now (the loop has not got
        to it yet) counted as one."""
        overdue = self._loop.time() - self._due >= self._behind_s
        return self.late_ticks + overdue >= self._streak

    def hold_s(self, age_s: float) -> float:
        """How long a stream that has run ``age_s`` waits after a write before its next: none
        while the loop keeps up or the stream is new (``HOLD_AFTER_S``); while the loop is busy,
        twice the latest lateness (up to ``MAX_HOLD_S``). A busy loop writes
        every stream at every turn, each turn longer for it; held, each stream is written less
        often with more tokens at once, and the turns shorten again."""
        if age_s < HOLD_AFTER_S or self.busy_ticks < self._streak:
            return 0.0
        return min(MAX_HOLD_S, 2 * self.late_s)
