"""Sessions stay on their worker whichever planner replica routes each turn."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

import httpx
import openai

from bus.client import Bus
from bus.registry import connect_etcd
from bus.sessions import SessionStore
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import (
    Event,
    RequestAccepted,
    RequestFailed,
    RequestSpec,
    RouteDecided,
    SamplingParams,
    utc_now,
)
from services.planner.handlers import Planner
from services.planner.policy_registry import make_policy
from tests.helpers import eventually, registration
from tests.live import ClusterFactory, observe


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
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
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


async def test_a_session_etcd_refuses_fails_its_request_at_once(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    """A session id too large for etcd used to be retried each second until its deadline."""
    etcd = connect_etcd(etcd_server.url)
    planner = Planner(bus, make_policy("kv"), "refusing", sessions=SessionStore(etcd, ttl_s=30))
    await planner.on_workers({"w": registration("w")})
    ended: list[RequestFailed] = []

    async def on_terminal(event: Event) -> None:
        if isinstance(event, RequestFailed):
            ended.append(event)

    await bus.subscribe(Subjects.planner_failures("refused-reply"), on_terminal)
    spec = RequestSpec(
        model="m",
        prompt_token_ids=(1, 2, 3),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=4),
        reply_to="refused-reply",
        deadline=utc_now() + timedelta(minutes=5),
    )
    accepted = RequestAccepted(
        source="test", request_id="r-huge", session_id="s" * 2_000_000, spec=spec
    )
    try:
        async with asyncio.timeout(10):
            await planner.on_request(accepted)  # returns: nothing to redeliver
        [failed] = await eventually(lambda: ended)
        assert failed.request_id == "r-huge" and failed.code == "invalid_request"
        assert "etcd refused" in failed.message and len(failed.message) < 1000
        assert not planner.cluster.is_routed("r-huge")
    finally:
        await etcd.close()


async def test_new_sessions_arriving_at_once_spread_over_the_workers(
    cluster_factory: ClusterFactory,
) -> None:
    """Each first turn waits on its session's claim in etcd: the requests routed meanwhile see
    it queued already, rather than all taking the worker that was idlest before the burst."""
    cluster = cluster_factory(workers=2, policy="kv")
    bus, seen = await observe(cluster.nats_url)
    users = [f"user-{n}" for n in range(8)]
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30
    ) as http:
        replies = await asyncio.gather(
            *(
                http.post("/completions", json={
                    "model": "laneway-sim", "prompt": f"{user} asks about traffic " * 40,
                    "max_tokens": 4, "user": user,
                })
                for user in users
            )
        )  # fmt: skip
    assert [r.status_code for r in replies] == [200] * len(users)
    routes = seen.events["RouteDecided"]
    await eventually(lambda: len(routes) == len(users))
    await bus.close()
    placed = Counter(r.worker_id for r in routes if isinstance(r, RouteDecided))
    assert max(placed.values()) <= 5, placed
