"""A placement is a stored publish, not a confirmed one: said again when the connection was lost
while it went out, since nothing else would tell the planner it never arrived."""

from __future__ import annotations

import asyncio
from typing import Any

from bus.channels import Topic
from bus.client import Bus
from bus.topology import Subjects
from schemas.events import Event, RequestAccepted, RequestPlaced, RouteDecided
from services.planner.handlers import Planner
from services.planner.policy_registry import make_policy
from tests.helpers import eventually, registration
from tests.ingress.helpers import request_spec


class ReconnectingBus(Bus):
    """A bus whose connection is made again while a route waits for its confirmation."""

    def __init__(self, bus: Bus, reconnect_on_route: bool) -> None:
        super().__init__(bus.nc)
        self._reconnect_on_route = reconnect_on_route
        self._reconnected = 0

    @property
    def reconnects(self) -> int:
        return self._reconnected

    async def publish(self, topic: Topic[Any], event: Any) -> None:
        await super().publish(topic, event)
        if isinstance(event, RouteDecided) and self._reconnect_on_route:
            self._reconnected += 1


async def placements_heard(bus: Bus, reconnect_on_route: bool) -> int:
    reply_to = f"placements{int(reconnect_on_route)}"
    heard: list[RequestPlaced] = []

    async def on_placement(event: Event) -> None:
        if isinstance(event, RequestPlaced):
            heard.append(event)

    await bus.subscribe(Subjects.placements(reply_to), on_placement)
    planner = Planner(ReconnectingBus(bus, reconnect_on_route), make_policy("round_robin"), "p")
    await planner.on_workers({"w": registration("w")})
    spec = request_spec(reply_to)
    await planner.on_request(RequestAccepted(source="test", request_id=reply_to, spec=spec))
    await eventually(lambda: heard)
    await asyncio.sleep(0.2)  # a second copy, if one was sent, has come by now
    assert {p.worker_id for p in heard} == {"w"}
    return len(heard)


async def test_a_placement_goes_once_on_a_steady_connection(bus: Bus) -> None:
    assert await placements_heard(bus, reconnect_on_route=False) == 1


async def test_a_placement_is_said_again_after_a_reconnect(bus: Bus) -> None:
    assert await placements_heard(bus, reconnect_on_route=True) == 2
