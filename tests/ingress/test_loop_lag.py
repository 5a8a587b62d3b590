"""An event loop that runs late is seen as behind, and no longer once it catches up."""

from __future__ import annotations

import asyncio
import time

from services.ingress.loop_lag import LoopLag


async def test_a_blocked_loop_is_behind_until_it_catches_up() -> None:
    lag = LoopLag(interval_s=0.01, behind_s=0.3)
    ticking = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        assert not lag.behind()
        time.sleep(0.45)  # work that holds the loop: the next tick is overdue already
        assert lag.behind()
        await asyncio.sleep(0)  # the late tick runs and says how late it was
        await asyncio.sleep(0.02)
        assert lag.late_s < 0.3 and not lag.behind()
    finally:
        ticking.cancel()
