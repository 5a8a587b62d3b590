"""What the ingress asks the planner to avoid, on a real nats-server: the workers it hears late
or not at all, on every attempt; and for ``SHUN_S`` the workers a stream moved off."""

from __future__ import annotations

import asyncio

import pytest

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import Event, RequestAccepted
from services.ingress import nats_gateway
from services.ingress.nats_gateway import NatsGateway
from tests.helpers import eventually
from tests.ingress.helpers import request_spec


async def test_every_attempt_avoids_the_unheard_and_for_a_while_the_workers_left(
    nats_bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nats_gateway, "SHUN_S", 0.5)
    unheard = {"u1"}
    gateway = NatsGateway(nats_bus, "avoiding", unheard=lambda: unheard)
    await gateway.start()
    accepted: list[RequestAccepted] = []

    async def on_accepted(event: Event) -> None:
        if isinstance(event, RequestAccepted) and event.spec.reply_to == "avoiding":
            accepted.append(event)

    await nats_bus.subscribe(Subjects.request_accepted, on_accepted)

    async def submitted(request_id: str) -> tuple[str, ...]:
        submitting = asyncio.create_task(anext(gateway.submit(request_id, None, spec)))
        await eventually(lambda: any(a.request_id == request_id for a in accepted))
        submitting.cancel()
        return next(a for a in accepted if a.request_id == request_id).spec.avoid_workers

    spec = request_spec("avoiding")
    assert await submitted("r1") == ("u1",)
    # A stream moved off w1: its next attempt avoids w1 first, and so do new requests a while.
    moved = accepted[0].model_copy(
        update={"spec": spec.model_copy(update={"attempt": 1, "avoid_workers": ("w1",)})}
    )
    assert gateway._avoid(moved).spec.avoid_workers == ("w1", "u1")
    assert await submitted("r2") == ("u1", "w1")
    await asyncio.sleep(0.6)
    unheard = set()
    assert await submitted("r3") == ()
