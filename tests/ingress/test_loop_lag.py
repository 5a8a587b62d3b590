"""An event loop that stays late is seen as behind, and no longer once it catches up; one long
turn now and then (a shared machine's) is not."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.ingress.loop_lag import BUSY_S, HOLD_AFTER_S, MAX_HOLD_S, LoopLag


async def _ticks_run() -> None:
    """A few turns of the loop, without sleeping: a tick due by now runs."""
    for _ in range(5):
        await asyncio.sleep(0)


async def _turn(seconds: float) -> None:
    """One turn of the loop that holds it for ``seconds``, then lets the ticks run."""
    time.sleep(seconds)
    await _ticks_run()


async def test_one_long_turn_is_not_behind() -> None:
    lag = LoopLag(interval_s=0.01, behind_s=0.2)
    ticking = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the tick is overdue by more than behind_s: one late tick
        assert not lag.behind()
        await asyncio.sleep(0.05)  # the late tick, then ticks on time again
        assert lag.late_ticks == 0 and not lag.behind()
    finally:
        ticking.cancel()


async def test_a_loop_that_stays_late_is_behind_until_it_catches_up() -> None:
    lag = LoopLag(interval_s=0.01, behind_s=0.2)
    ticking = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        await _turn(0.3)
        assert lag.late_ticks == 1 and not lag.behind()
        time.sleep(0.3)  # a second long turn in a row: its tick overdue too
        assert lag.behind()
        await _ticks_run()  # that tick came late: two in a row
        assert lag.late_ticks == 2 and lag.behind()
        await asyncio.sleep(0.05)  # ticks on time again
        assert lag.late_ticks == 0 and not lag.behind()
    finally:
        ticking.cancel()


async def test_streak_is_checked() -> None:
    with pytest.raises(ValueError):
        LoopLag(streak=0)


async def test_a_busy_loop_holds_streams_back_and_a_keeping_up_one_does_not() -> None:
    lag = LoopLag(interval_s=0.01, behind_s=10.0)
    old = HOLD_AFTER_S
    ticking = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        assert lag.hold_s(old) == 0.0
        await _turn(BUSY_S + 0.05)
        assert lag.hold_s(old) == 0.0  # one long turn is no busy loop
        await _turn(BUSY_S + 0.05)
        assert 2 * BUSY_S <= lag.hold_s(old) <= MAX_HOLD_S
        assert lag.hold_s(HOLD_AFTER_S / 2) == 0.0  # a new stream's tokens go out as they come
        await _turn(1.0)
        assert lag.hold_s(old) == MAX_HOLD_S
        await asyncio.sleep(0.05)
        assert lag.hold_s(old) == 0.0
    finally:
        ticking.cancel()


async def test_each_tick_is_told_how_late_it_came() -> None:
    heard: list[float] = []
    lag = LoopLag(interval_s=0.01, on_tick=heard.append)
    ticking = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.05)
        await _turn(0.2)
        await asyncio.sleep(0.03)
    finally:
        ticking.cancel()
    assert len(heard) >= 4 and heard[-1] < 0.1
    assert max(heard) == pytest.approx(0.2, abs=0.05) and max(heard) >= 0.15
