"""Sessions stay on their worker whichever planner replica routes each turn."""

from __future__ import annotations

import asyncio

import openai

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import Event, RouteDecided
from tests.conftest import ClusterFactory


async def test_ten_turns_stay_on_one_worker_across_two_planners(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=3, planners=2, policy="kv")
    bus = await Bus.connect(cluster.nats_url, "test-sessions")
    routes: list[RouteDecided] = []

    async def observe(event: Event) -> None:
        if isinstance(event, RouteDecided):
            routes.append(event)

    await bus.subscribe(Subjects.all_routes, observe)
    client = openai.AsyncOpenAI(base_url=cluster.config.base_url, api_key="x", max_retries=0)
    conversations = {"alice": [], "bob": []}  # type: dict[str, list[dict[str, str]]]
    for turn in range(10):
        for user, history in conversations.items():
            history.append({"role": "user", "content": f"turn {turn} from {user} " * 10})
            reply = await client.chat.completions.create(
                model="laneway-sim",
                messages=history,  # type: ignore[arg-type]
                max_tokens=20,
                user=user,
            )
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    await asyncio.sleep(0.2)
    await bus.close()
    for user in conversations:
        mine = [r for r in routes if r.session_id == user]
        assert len(mine) == 10
        assert len({r.worker_id for r in mine}) == 1, [r.reason for r in mine]
    deciders = {r.source for r in routes}
    assert len(deciders) == 2, "both planner replicas should have routed some turns"
