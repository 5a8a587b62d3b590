"""Weighted fair share in admission, on an in-memory clock: room held back for a tenant below its
share, who is woken first, the longer wait for held-back room, weights, the window after which
a tenant no longer counts, and a full queue."""

from __future__ import annotations

import asyncio

import pytest

from services.ingress.admission import Admission, AdmissionSettings, AdmissionTicket
from services.ingress.errors import Overloaded
from services.ingress.metrics import IngressMetrics
from tests.ingress.helpers import Clock


def make(clock: Clock, **settings: object) -> Admission:
    return Admission(AdmissionSettings(**settings), IngressMetrics(), clock)  # type: ignore[arg-type]


async def test_room_a_tenant_below_its_share_used_is_not_taken_by_one_over_it() -> None:
    clock = Clock()
    admission = make(clock, max_in_flight=4, max_wait_s=0.0, share_wait_s=0.0)
    light = await admission.admit("normal", "light")
    heavy = [await admission.admit("normal", "heavy") for _ in range(3)]
    light.release()
    # One room is free, and the light tenant used it just now: the heavy one, over its share
    # of 2, is shed rather than take it.
    with pytest.raises(Overloaded):
        await admission.admit("normal", "heavy")
    assert admission.in_cluster == 3
    light = await admission.admit("normal", "light")
    # Once the light tenant has what it used, the rest is anyone's.
    heavy.pop().release()
    heavy.append(await admission.admit("normal", "heavy"))
    for ticket in [light, *heavy]:
        ticket.release()


async def test_held_back_room_goes_to_anyone_once_its_tenant_is_gone_a_window() -> None:
    clock = Clock()
    admission = make(clock, max_in_flight=2, max_wait_s=0.0, share_window_s=1.0)
    (await admission.admit("normal", "light")).release()
    heavy = await admission.admit("normal", "heavy")
    with pytest.raises(Overloaded):
        await admission.admit("normal", "heavy")
    clock.now += 1.5
    (await admission.admit("normal", "heavy")).release()
    heavy.release()


async def test_without_keys_one_tenant_takes_all_the_room() -> None:
    admission = make(Clock(), max_in_flight=3, max_wait_s=0.0)
    tickets = [await admission.admit("normal") for _ in range(3)]
    with pytest.raises(Overloaded):
        await admission.admit("normal")
    for ticket in tickets:
        ticket.release()


async def test_weights_divide_the_room() -> None:
    """Shares of 3 and 1 of 4: the tenant of weight 1 holds one, the other may take three."""
    admission = make(Clock(), max_in_flight=4, max_wait_s=0.0, share_wait_s=0.0)
    small = await admission.admit("normal", "small", 1.0)
    big = [await admission.admit("normal", "big", 3.0) for _ in range(2)]
    small.release()
    small = await admission.admit("normal", "small", 1.0)
    big.append(await admission.admit("normal", "big", 3.0))
    # Full; when one of big's ends, small (at its share) may not take it from big (below its
    # share and its demand).
    with pytest.raises(Overloaded):
        await admission.admit("normal", "small", 1.0)
    big.pop().release()
    with pytest.raises(Overloaded):
        await admission.admit("normal", "small", 1.0)
    big.append(await admission.admit("normal", "big", 3.0))
    for ticket in [small, *big]:
        ticket.release()


async def test_the_tenant_using_least_of_its_share_is_woken_first() -> None:
    admission = make(Clock(), max_in_flight=4, max_wait_s=5.0)
    held = [await admission.admit("normal", "heavy") for _ in range(3)]
    held.append(await admission.admit("normal", "light"))
    order: list[str] = []

    async def wait(tenant: str) -> AdmissionTicket:
        ticket = await admission.admit("normal", tenant)
        order.append(tenant)
        return ticket

    heavy_waiter = asyncio.create_task(wait("heavy"))
    await asyncio.sleep(0)
    light_waiter = asyncio.create_task(wait("light"))
    await asyncio.sleep(0)
    held.pop(0).release()  # one of heavy's ends: light, holding 1 to heavy's 2, gets it
    await asyncio.sleep(0)
    assert order == ["light"]
    held.pop(0).release()  # heavy holds 1 to light's 2
    held.append(await heavy_waiter)
    assert order == ["light", "heavy"]
    for ticket in [*held, await light_waiter]:
        ticket.release()


async def test_contending_tenants_wait_their_turn_past_max_wait_each_queue_in_order() -> None:
    admission = make(Clock(), max_in_flight=2, max_wait_s=0.01, share_wait_s=5.0)
    held = [await admission.admit("normal", t) for t in ("light", "heavy")]
    first = asyncio.create_task(admission.admit("normal", "heavy"))
    await asyncio.sleep(0)
    second = asyncio.create_task(admission.admit("normal", "heavy"))
    light = asyncio.create_task(admission.admit("normal", "light"))
    await asyncio.sleep(0.05)  # past max_wait_s: all still wait, as tenants contend
    assert not any(task.done() for task in (first, second, light))
    held.pop(0).release()  # the light tenant's: to its waiter, using least of its share
    held.append(await light)
    held.pop(0).release()  # the heavy tenant's: to its oldest waiter, not its newest
    held.append(await first)
    assert not second.done()
    held.pop().release()
    held.append(await second)
    for ticket in held:
        ticket.release()
    assert admission.in_cluster == admission.queued == 0


async def test_one_tenant_alone_is_shed_at_max_wait() -> None:
    admission = make(Clock(), max_in_flight=1, max_wait_s=0.01, share_wait_s=5.0)
    held = await admission.admit("normal", "heavy")
    with pytest.raises(Overloaded):
        await admission.admit("normal", "heavy")
    held.release()


async def test_a_full_queue_sheds_the_waiter_of_the_tenant_most_over_its_share() -> None:
    admission = make(Clock(), max_in_flight=2, max_queue=2, max_wait_s=5.0, share_wait_s=5.0)
    held = [await admission.admit("normal", "heavy") for _ in range(2)]
    old, new = (asyncio.create_task(admission.admit("normal", "heavy")) for _ in range(2))
    await asyncio.sleep(0)
    # Heavy, holding all the room, is shed for a newcomer of its own...
    with pytest.raises(Overloaded):
        await admission.admit("normal", "heavy")
    # ...but its oldest waiter makes way for a light tenant's.
    light = asyncio.create_task(admission.admit("normal", "light"))
    with pytest.raises(Overloaded):
        await old
    held.pop().release()
    held.append(await light)
    held.pop(0).release()
    held.append(await new)
    for ticket in held:
        ticket.release()
    assert admission.in_cluster == admission.queued == 0
