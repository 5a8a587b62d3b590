"""Admission control's rules, on an in-memory clock and load: the bound, the priority queue,
shedding, and other replicas' requests as the workers' load reports show them."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.liveness import QUIET_S, Liveness
from services.ingress.admission import Admission, AdmissionSettings, AdmissionTicket, Priority
from services.ingress.errors import Overloaded
from services.ingress.metrics import IngressMetrics
from tests.helpers import load_report, registration
from tests.ingress.helpers import Clock, sample


def make(clock: Clock | None = None, **settings: object) -> tuple[Admission, IngressMetrics]:
    metrics = IngressMetrics()
    admission = Admission(AdmissionSettings(**settings), metrics, clock or Clock())  # type: ignore[arg-type]
    return admission, metrics


async def test_no_bound_until_a_worker_registers() -> None:
    admission, _ = make()
    assert admission.capacity is None
    tickets = [await admission.admit("low") for _ in range(1000)]
    assert admission.in_cluster == 1000
    for ticket in tickets:
        ticket.release()
    assert admission.in_cluster == 0


async def test_capacity_is_each_serving_workers_slots_and_queue() -> None:
    admission, _ = make(queue_per_worker=2)
    draining = registration("w2").model_copy(update={"draining": True})
    prefill = registration("w3").model_copy(update={"role": "prefill"})
    workers = {"w0": registration("w0"), "w1": registration("w1"), "w2": draining, "w3": prefill}
    await admission.on_workers(workers)
    # max_num_seqs 4 + 2 queued, for w0 and w1 only.
    assert admission.capacity == 12
    # An operator's fixed bound below the workers' wins.
    bounded, _ = make(queue_per_worker=2, max_in_flight=5)
    await bounded.on_workers(workers)
    assert bounded.capacity == 5


async def test_a_silent_worker_adds_no_room_unless_every_one_is_silent() -> None:
    """A worker that stopped reporting (frozen, its lease kept alive by anyone) is not live by
    the planner's rule, which routes to it only when no worker is heard at all."""
    clock = Clock()
    liveness = Liveness(clock=clock)
    admission = Admission(AdmissionSettings(), IngressMetrics(), clock, liveness=liveness)
    workers = {"w0": registration("w0"), "w1": registration("w1")}
    liveness.registered(workers)
    await admission.on_workers(workers)
    assert admission.capacity == 8
    clock.now += QUIET_S + 1
    liveness.reported("w1")
    assert admission.capacity == 4
    clock.now += QUIET_S + 1  # nothing heard from anyone: this ingress or the bus stalled
    assert admission.capacity == 8


async def test_beyond_capacity_a_request_waits_then_is_shed_fast() -> None:
    admission, metrics = make(max_in_flight=2, max_wait_s=0.05)
    first, _second = await admission.admit("normal"), await admission.admit("normal")
    started = asyncio.get_running_loop().time()
    with pytest.raises(Overloaded) as shed:
        await admission.admit("normal")
    assert 0.04 < asyncio.get_running_loop().time() - started < 0.1
    assert shed.value.status == 429
    assert shed.value.headers == [(b"retry-after", b"1")]
    assert sample(metrics, "laneway_ingress_shed_total", reason="wait_timeout", priority="normal")
    assert admission.queued == 0
    # Room given back goes to the next request.
    first.release()
    third = await admission.admit("normal")
    assert admission.in_cluster == 2
    third.release()
    assert sample(metrics, "laneway_ingress_admitted_total", priority="normal") == 3


async def test_room_goes_to_the_best_priority_first_then_the_newest() -> None:
    admission, _ = make(max_in_flight=1, max_wait_s=5.0)
    held = await admission.admit("normal")
    order: list[str] = []

    async def wait(name: str, priority: Priority) -> None:
        ticket = await admission.admit(priority)
        order.append(name)
        await asyncio.sleep(0)
        ticket.release()

    queued: list[tuple[str, Priority]] = [("low", "low"), ("normal-1", "normal"), ("high", "high")]
    waiters = [asyncio.create_task(wait(name, priority)) for name, priority in queued]
    waiters.append(asyncio.create_task(wait("normal-2", "normal")))
    await asyncio.sleep(0.01)
    assert admission.queued == 4
    # A newcomer does not jump the queue of its own priority or better.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await admission.admit("normal")
    held.release()
    await asyncio.gather(*waiters)
    assert order == ["high", "normal-2", "normal-1", "low"]
    assert admission.in_cluster == 0


async def test_a_full_queue_sheds_the_oldest_lower_priority_waiter() -> None:
    admission, metrics = make(max_in_flight=1, max_queue=2, max_wait_s=5.0)
    held = await admission.admit("normal")
    low_old = asyncio.create_task(admission.admit("low"))
    low_new = asyncio.create_task(admission.admit("low"))
    await asyncio.sleep(0)
    # Full, and nothing below low: the newcomer is shed at once.
    with pytest.raises(Overloaded):
        await admission.admit("low")
    assert sample(metrics, "laneway_ingress_shed_total", reason="queue_full", priority="low")
    high = asyncio.create_task(admission.admit("high"))
    with pytest.raises(Overloaded):
        await low_old
    assert sample(metrics, "laneway_ingress_shed_total", reason="displaced", priority="low")
    held.release()
    (await high).release()
    (await low_new).release()
    assert admission.in_cluster == 0


async def test_a_waiter_that_leaves_takes_no_room() -> None:
    admission, _ = make(max_in_flight=1, max_wait_s=5.0)
    held = await admission.admit("normal")
    leaving = asyncio.create_task(admission.admit("normal"))
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert admission.queued == 0
    held.release()
    assert admission.in_cluster == 0
    (await admission.admit("normal")).release()


async def test_a_waiter_given_room_as_it_leaves_gives_it_back() -> None:
    admission, _ = make(max_in_flight=1, max_wait_s=5.0)
    held = await admission.admit("normal")
    leaving = asyncio.create_task(admission.admit("normal"))
    await asyncio.sleep(0)
    held.release()  # room handed over; the waiter has not run yet
    assert admission.in_cluster == 1
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert admission.in_cluster == 0


async def test_other_replicas_requests_count_from_the_load_reports() -> None:
    clock = Clock()
    admission, _ = make(clock, max_wait_s=0.0, report_lag_s=0.25)
    await admission.on_workers({"w0": registration("w0"), "w1": registration("w1")})
    assert admission.capacity == 8
    # Another replica's 5 requests are on the workers.
    await admission.on_load(load_report("w0", running=3))
    await admission.on_load(load_report("w1", running=1, waiting=1))
    tickets = [await admission.admit("normal") for _ in range(3)]
    with pytest.raises(Overloaded):
        await admission.admit("high")
    # A report from a worker no longer registered does not count.
    await admission.on_load(load_report("gone", running=50))
    assert admission.in_cluster == 8
    for ticket in tickets:
        ticket.release()


async def test_its_own_requests_are_not_counted_twice_while_reports_lag() -> None:
    clock = Clock()
    admission, _ = make(clock, max_wait_s=0.0, report_lag_s=0.25)
    await admission.on_workers({"w0": registration("w0")})
    tickets: list[AdmissionTicket] = [await admission.admit("normal") for _ in range(4)]
    # The worker reports this replica's own four.
    await admission.on_load(load_report("w0", running=4))
    assert admission.in_cluster == 4
    tickets.pop().release()
    tickets.pop().release()
    # The report still shows them: within the lag they are this replica's, so room is free.
    clock.now += 0.1
    assert admission.in_cluster == 2
    tickets.append(await admission.admit("normal"))
    # Past the lag, a report still showing four means one of another replica's.
    clock.now += 0.3
    await admission.on_load(load_report("w0", running=4))
    assert admission.in_cluster == 4
    with pytest.raises(Overloaded):
        await admission.admit("normal")
    # A report older than its time to live no longer counts.
    clock.now += 10.0
    assert admission.in_cluster == 3
    for ticket in tickets:
        ticket.release()


async def test_a_new_worker_lets_waiters_in() -> None:
    admission, _ = make(max_wait_s=5.0)
    await admission.on_workers({"w0": registration("w0")})
    tickets = [await admission.admit("normal") for _ in range(4)]
    waiting = asyncio.create_task(admission.admit("normal"))
    await asyncio.sleep(0)
    assert not waiting.done()
    await admission.on_workers({"w0": registration("w0"), "w1": registration("w1")})
    tickets.append(await waiting)
    for ticket in tickets:
        ticket.release()


def test_settings_are_checked() -> None:
    for bad in ({"max_queue": -1}, {"retry_after_s": 0}, {"max_in_flight": 0}, {"max_wait_s": -1}):
        with pytest.raises(ValueError):
            AdmissionSettings(**bad)


async def test_an_ingress_that_is_behind_takes_no_new_request_until_it_catches_up() -> None:
    behind = True
    metrics = IngressMetrics()
    admission = Admission(
        AdmissionSettings(max_wait_s=0.01), metrics, Clock(), pressure=lambda: behind
    )
    with pytest.raises(Overloaded):
        await admission.admit("high")
    assert sample(metrics, "laneway_ingress_shed_total", reason="wait_timeout", priority="high")
    waiting = asyncio.create_task(admission.admit("normal"))
    await asyncio.sleep(0)
    behind = False
    await admission.on_load(load_report("w1", 0))  # the next report, or a release, lets it in
    ticket = await waiting
    assert admission.in_cluster == 1
    ticket.release()


async def test_room_given_back_as_a_wait_runs_out_is_not_handed_to_the_waiter_leaving() -> None:
    """The wait's timeout and a release come due in the same turn of the loop (the timeout
    first): the waiter leaves as shed, and the room given back stays free."""
    admission, _ = make(max_in_flight=1, max_wait_s=0.01)
    held = await admission.admit("normal")
    waiting = asyncio.create_task(admission.admit("normal"))
    await asyncio.sleep(0)  # it waits, its timeout set
    asyncio.get_running_loop().call_later(0.01, held.release)
    time.sleep(0.03)  # both are due when the loop next looks
    with pytest.raises(Overloaded):
        await waiting
    assert admission.in_cluster == 0 and admission.queued == 0
    (await admission.admit("normal")).release()
