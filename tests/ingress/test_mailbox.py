"""A request's arrivals: runs that follow one another come as one event, anything else as it
came, in order."""

from __future__ import annotations

import asyncio

from schemas.events import TokenBatch, TokenRun, TokensGenerated
from services.ingress.mailbox import Mailbox
from tests.ingress.helpers import finished


def step(worker_id: str, *runs: TokenRun) -> TokenBatch:
    return TokenBatch(source=f"worker/{worker_id}", worker_id=worker_id, runs=runs)


def run(index: int, text: str, attempt: int = 0) -> TokenRun:
    return TokenRun(
        request_id="r1", attempt=attempt, index=index, token_ids=tuple(text.encode()), text=text
    )


def taken(box: Mailbox) -> list[tuple[str, int, str]]:
    out = []
    while not box.empty():
        event = box.get_nowait()
        if isinstance(event, TokensGenerated):
            out.append((event.worker_id, event.index, event.text))
        else:
            out.append((event.type, 0, ""))
    return out


async def test_runs_one_after_another_of_one_worker_and_attempt_come_as_one() -> None:
    box = Mailbox()
    first, second = step("w1", run(0, "ab")), step("w1", run(2, "c"))
    box.put_run(first, first.runs[0])
    box.put_run(second, second.runs[0])
    box.put_run(second, run(3, "d"))
    box.put_run(second, run(5, "f"))  # after a gap
    box.put_run(step("w2"), run(6, "g"))  # another worker's
    box.put_run(second, run(7, "h", attempt=1))  # another attempt's
    box.put_nowait(finished(8))
    box.put_run(second, run(8, "i"))
    assert taken(box) == [
        ("w1", 0, "abcd"),
        ("w1", 5, "f"),
        ("w2", 6, "g"),
        ("w1", 7, "h"),
        ("RequestFinished", 0, ""),
        ("w1", 8, "i"),
    ]


async def test_a_waiting_taker_wakes_at_the_next_arrival() -> None:
    box = Mailbox()
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(box.arrival(loop.time() + 5))
    await asyncio.sleep(0)
    assert not waiting.done()
    batch = step("w1", run(0, "a"))
    box.put_run(batch, batch.runs[0])
    assert await asyncio.wait_for(waiting, 1)
    event = box.get_nowait()
    assert isinstance(event, TokensGenerated) and event.text == "a"
    assert await box.arrival(loop.time() - 1) is False  # nothing left: the deadline passed


async def test_a_taker_waits_no_longer_than_its_deadline() -> None:
    box = Mailbox()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(box.arrival(started + 0.05), 1) is False
    assert loop.time() - started >= 0.05
    # A cancelled wait leaves nothing behind: the next arrival still wakes the next taker.
    cancelled = asyncio.create_task(box.arrival(loop.time() + 5))
    await asyncio.sleep(0)
    cancelled.cancel()
    waiting = asyncio.create_task(box.arrival(loop.time() + 5))
    await asyncio.sleep(0)
    box.put_nowait(finished(0))
    assert await asyncio.wait_for(waiting, 1)


async def test_each_wait_ends_at_its_own_deadline_whatever_the_waits_before() -> None:
    """A timer is left armed when an arrival wakes the taker: a later wait with a later
    deadline is not woken by it early, one with an earlier deadline not late."""
    box = Mailbox()
    loop = asyncio.get_running_loop()

    async def woken(deadline: float) -> None:
        waiting = asyncio.create_task(box.arrival(deadline))
        await asyncio.sleep(0)
        box.put_nowait(finished(0))
        assert await waiting
        box.get_nowait()

    await woken(loop.time() + 1.0)  # its timer, at 1 s, stays
    started = loop.time()
    assert await asyncio.wait_for(box.arrival(started + 0.02), 1) is False
    assert 0.02 <= loop.time() - started < 0.5
    await woken(loop.time() + 0.05)  # its timer, at 50 ms, stays
    started = loop.time()
    assert await asyncio.wait_for(box.arrival(started + 0.15), 1) is False
    assert loop.time() - started >= 0.15
