"""Two planner replicas on a real nats-server share the intake; one whose requests come late
leaves them all to the other, and takes its share again after ``HOLD_S``; when both hear them
late, only one leaves."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from bus.client import Bus
from bus.registry import LeasedKey, connect_etcd
from bus.topology import PLANNER_INTAKE, REQUESTS, Subjects
from infra.embedded import EmbeddedServer
from schemas.events import Event, RequestAccepted, RequestPlaced
from services.planner import handlers, intake_gate
from services.planner.handlers import Planner
from services.planner.intake_turn import IntakeTurn
from services.planner.policy_registry import make_policy
from tests.helpers import eventually, registration
from tests.ingress.helpers import request_spec

REPLY_TO = "intakelive"


async def test_a_replica_whose_requests_come_late_leaves_them_to_the_other(
    nats_bus: Bus,
    nats_server: EmbeddedServer,
    own_etcd: EmbeddedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(intake_gate, "HOLD_S", 1.5)
    monkeypatch.setattr(handlers, "HOLD_S", 1.5)
    js = nats_bus.js
    with contextlib.suppress(Exception):
        await js.delete_consumer(REQUESTS.name, PLANNER_INTAKE.durable)
    await js.purge_stream(REQUESTS.name, subject=Subjects.request_accepted.subject)
    placed: Counter[str] = Counter()

    async def on_placed(event: Event) -> None:
        if isinstance(event, RequestPlaced):
            placed[event.source] += 1

    await nats_bus.subscribe(Subjects.placements(REPLY_TO), on_placed)
    buses = [await Bus.connect(nats_server.url, f"p{i}") for i in range(2)]
    slow, steady = (Planner(b, make_policy("round_robin"), name) for b, name in
                    zip(buses, ("slow", "steady"), strict=True))  # fmt: skip
    etcd = connect_etcd(own_etcd.url)
    keeping = []
    # Each takes its turn out of the intake on etcd. Only the steady one is registered at
    # first, so that it alone sees no other replica to leave the requests to, and stays.
    for planner, name in ((slow, "slow"), (steady, "steady")):
        await planner.on_workers({"w": registration("w")})
        await planner.attach()
        keeping.append(asyncio.create_task(planner.keep_intake(IntakeTurn(etcd, name))))
    await LeasedKey.planner(etcd, "steady", ttl_s=5).start()
    sent = 0

    async def send(count: int, age_s: float) -> None:
        nonlocal sent
        for _ in range(count):
            sent += 1
            accepted = RequestAccepted(
                source="ingress/i",
                request_id=f"r{sent}",
                occurred_at=datetime.now(UTC) - timedelta(seconds=age_s),
                spec=request_spec(REPLY_TO),
            )
            await nats_bus.publish(Subjects.request_accepted, accepted)
            await asyncio.sleep(0.05)

    try:
        await send(30, 0.0)  # each learns the usual delay
        await eventually(lambda: sum(placed.values()) == sent)
        assert placed["planner/slow"] and placed["planner/steady"]
        # Every request comes 3 s late: the one with another replica leaves.
        await send(30, 3.0)
        await eventually(lambda: not slow.intake.taking, message="the slow one did not leave")
        assert steady.intake.taking and slow.metrics.intake_left._value.get() == 1
        await eventually(lambda: sum(placed.values()) == sent)
        before = placed["planner/slow"]
        await send(15, 0.0)
        await eventually(lambda: sum(placed.values()) == sent)
        assert placed["planner/slow"] == before  # all went to the steady one
        await eventually(lambda: slow.intake.taking, timeout=5, message="it did not come back")
        await send(30, 0.0)
        await eventually(lambda: sum(placed.values()) == sent)
        assert placed["planner/slow"] > before
        # Both registered, both hear them late (a healed link's backlog): one leaves, the
        # other keeps taking them.
        await LeasedKey.planner(etcd, "slow", ttl_s=5).start()
        left = slow.metrics.intake_left._value.get() + steady.metrics.intake_left._value.get()
        await send(30, 3.0)
        await eventually(lambda: not (slow.intake.taking and steady.intake.taking))
        await asyncio.sleep(1.0)
        assert slow.intake.taking or steady.intake.taking
        now_left = slow.metrics.intake_left._value.get() + steady.metrics.intake_left._value.get()
        assert now_left == left + 1
        await eventually(lambda: sum(placed.values()) == sent)
    finally:
        for task in keeping:
            task.cancel()
        for b in buses:
            await b.close()
        await etcd.close()
