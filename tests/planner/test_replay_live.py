"""The log holds every input of every decision: a real cluster (all services, sessions, two
planner replicas) serves conversations, then each decision read back from JetStream is made
again by the current code, from the event and its replica's recorded settings alone, identically.
"""

from __future__ import annotations

import asyncio

import openai

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import PlannerConfigured, RouteDecided
from services.planner.replay import differences, redecide, settings_of
from tests.helpers import eventually
from tests.live import ClusterFactory

MODEL = "laneway-sim"


async def test_every_decision_of_a_live_cluster_replays_identically(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=3, planners=2)
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )

    async def conversation(user: int) -> None:
        history = f"user {user} asks about the weather in a city with a long name. " * 6
        for turn in range(4):
            history += f" turn {turn}:"
            answer = await client.completions.create(
                model=MODEL, prompt=history, max_tokens=8, user=f"user-{user}"
            )
            history += answer.choices[0].text

    await asyncio.gather(*(conversation(u) for u in range(8)))
    bus = await Bus.connect(cluster.nats_url, "test-replay")
    configs: dict[str, PlannerConfigured] = {}
    decisions: dict[str, RouteDecided] = {}

    async def on_config(event: PlannerConfigured, _: int) -> None:
        configs[event.source] = event

    async def on_route(event: RouteDecided, _: int) -> None:
        decisions[event.event_id] = event

    try:
        await bus.replay(Subjects.planner_configured, 0, on_config)
        await bus.replay(Subjects.route_decisions, 0, on_route)
        await eventually(lambda: len(decisions) == 32 and len(configs) == 2)
    finally:
        await bus.close()
    assert {e.source for e in decisions.values()} == set(configs), "both replicas decided"
    assert any(c.owns_session for e in decisions.values() for c in e.candidates)
    for event in decisions.values():
        policy, disagg = settings_of(configs[event.source])
        assert differences(event, redecide(event, policy, disagg)) == [], event.request_id
