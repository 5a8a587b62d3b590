"""The router is deterministic given its log: a live run with everything that changes the planner's
view under it (two planner replicas, sessions, remote and local prefills, a worker killed, a role
moved by the capacity loop) is read back from JetStream, and every one of its decisions is made
again, identically, by the current code. A change that makes routing depend on anything not on
the log fails here."""

from __future__ import annotations

import asyncio
import os
import signal

import openai

from bus.client import Bus
from bus.topology import Subjects
from schemas.events import PlannerConfigured, RequestFailed, RolesRebalanced, RouteDecided
from services.planner.replay import differences, redecide, settings_of
from tests.helpers import eventually
from tests.live import ClusterFactory, registrations

MODEL = "laneway-sim"
USERS, TURNS = 25, 8
ENV = {
    "LANEWAY_DISAGG": "auto",
    "LANEWAY_DISAGG_MIN_REMOTE_TOKENS": "0",
    # A TTFT target nothing meets: the capacity loop moves a worker at its first look.
    "LANEWAY_AUTOSCALE": "true",
    "LANEWAY_TTFT_TARGET_MS": "0.001",
    "LANEWAY_ITL_TARGET_MS": "1000000",
    "LANEWAY_PLAN_INTERVAL_S": "1",
}


async def test_a_live_run_replays_to_identical_decisions(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=3, prefill_workers=1, planners=2, env=ENV)
    workers = await registrations(cluster.etcd_endpoints)
    victim = next(r for r in workers.values() if r.role == "decode")
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    served = 0
    # The capacity loop looks once a second; on a loaded machine the conversations can be over
    # before its first move, so they go on (up to twice as long) until one is seen.
    watch = await Bus.connect(cluster.nats_url, "test-determinism-watch")
    rebalanced: list[RolesRebalanced] = []

    async def on_rebalanced(event: RolesRebalanced) -> None:
        rebalanced.append(event)

    await watch.subscribe(Subjects.roles_rebalanced, on_rebalanced)

    async def conversation(user: int) -> None:
        nonlocal served
        history = f"user {user} wants a summary of a long report on city traffic. " * 8
        for turn in range(3 * TURNS):
            if turn >= TURNS and rebalanced:
                break
            history += f" turn {turn}:"
            try:
                answer = await client.completions.create(
                    model=MODEL, prompt=history, max_tokens=6, user=f"user-{user}", timeout=30
                )
                history += answer.choices[0].text
            except openai.APIError:  # it was on the killed worker: the next turn goes on
                pass
            served += 1

    async def kill_a_worker() -> None:
        await eventually(lambda: served >= USERS * TURNS // 3, timeout=60)
        os.kill(victim.pid, signal.SIGKILL)

    await asyncio.gather(kill_a_worker(), *(conversation(u) for u in range(USERS)))
    await watch.close()
    bus = await Bus.connect(cluster.nats_url, "test-determinism")
    configs: dict[str, PlannerConfigured] = {}
    decisions: dict[str, RouteDecided] = {}
    moves: list[RolesRebalanced] = []
    lost: list[RequestFailed] = []

    async def on_config(event: PlannerConfigured, _: int) -> None:
        configs[event.source] = event

    async def on_route(event: RouteDecided, _: int) -> None:
        decisions[event.request_id or ""] = event

    async def on_move(event: RolesRebalanced, _: int) -> None:
        moves.append(event)

    async def on_failed(event: RequestFailed, _: int) -> None:
        lost.append(event)

    try:
        await bus.replay(Subjects.planner_configured, 0, on_config)
        await bus.replay(Subjects.roles_rebalanced, 0, on_move)
        await bus.replay(Subjects.all_request_terminals.only(RequestFailed), 0, on_failed)
        await bus.replay(Subjects.route_decisions, 0, on_route)
        await eventually(lambda: len(decisions) >= served, timeout=15)
    finally:
        await bus.close()
    # What the run went through.
    assert len(configs) == 2 and {e.source for e in decisions.values()} == set(configs)
    assert moves, "the capacity loop moved no worker"
    assert any(e.worker_id == victim.worker_id for e in decisions.values())
    assert any(e.code == "worker_lost" or e.worker_id == victim.worker_id for e in lost)
    assert any(c.owns_session for e in decisions.values() for c in e.candidates)
    placements = [e.prefill for e in decisions.values() if e.prefill is not None]
    assert any(p.prefill_worker_id for p in placements)
    assert any(p.prefill_worker_id is None for p in placements)
    # And every decision made again from the log alone.
    moved = {}
    for request_id, event in decisions.items():
        policy, disagg = settings_of(configs[event.source])
        diff = differences(event, redecide(event, policy, disagg))
        if diff:
            moved[request_id] = diff
    assert moved == {}
