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
from schemas.events import PlannerConfigured, RolesRebalanced, RouteDecided
from schemas.messages import WorkerRegistration
from services.planner.replay import differences, redecide, settings_of
from tests.helpers import eventually
from tests.live import ClusterFactory, registrations

MODEL = "laneway-sim"
USERS, TURNS = 25, 8
ENV = {
    "LANEWAY_DISAGG": "auto",
    "LANEWAY_DISAGG_MIN_REMOTE_TOKENS": "0",
    # A hand-off costs next to nothing: a prompt goes to the prefill pool whenever its decode
    # worker is busier, and stays whenever it is not, however loaded the machine is.
    "LANEWAY_LINK_GB_S": "1000",
    "LANEWAY_LINK_LATENCY_MS": "0",
    # A TTFT target nothing meets: the capacity loop moves a worker at its first look.
    "LANEWAY_AUTOSCALE": "true",
    "LANEWAY_TTFT_TARGET_MS": "0.001",
    "LANEWAY_ITL_TARGET_MS": "1000000",
    "LANEWAY_PLAN_INTERVAL_S": "1",
}
# Errors of requests that never got a decision: shed by admission, or no decode worker left
# for a moment (the capacity loop moves one back once it sees none).
UNDECIDED = frozenset({"server_overloaded", "no_worker"})


async def test_a_live_run_replays_to_identical_decisions(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=3, prefill_workers=1, planners=2, env=ENV)
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
    # Where each request went, so the victim is the worker of a request known to be running.
    routed: dict[str, str] = {}

    async def on_routed(event: RouteDecided) -> None:
        routed.setdefault(event.request_id or "", event.worker_id)

    await watch.subscribe(Subjects.route_decisions, on_routed)

    async def worker_of(request_id: str) -> str:
        await eventually(lambda: request_id in routed, timeout=10)
        return routed[request_id]

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
            except openai.APIError as error:  # it was on the killed worker: the next turn goes on
                if error.code in UNDECIDED:
                    continue
            served += 1

    async def kill_a_worker() -> tuple[WorkerRegistration, str, bool]:
        nonlocal served
        await eventually(lambda: served >= USERS * TURNS // 3, timeout=60)
        # A long answer (400 tokens of 5 ms each) is streamed; once its first token is here
        # it runs on its worker for seconds more, however loaded the machine is, and that
        # worker is killed under it, and the request moves on to another (the ingress hears
        # the planner's worker_lost or its own silence first). Six-token turns can end
        # between a route and a kill.
        decoding: dict[str, WorkerRegistration] = {}
        for _ in range(10):
            stream = await client.completions.create(
                model=MODEL,
                prompt="a long story about traffic. " * 8,
                max_tokens=400,
                stream=True,
                timeout=60,
            )
            first = await anext(aiter(stream))
            request_id = first.id.removeprefix("cmpl-")
            worker = await worker_of(request_id)
            decoding = {
                w: r
                for w, r in (await registrations(cluster.etcd_endpoints)).items()
                if r.role == "decode"
            }
            if worker in decoding:
                break
            async for _ in stream:  # the capacity loop moved its worker meanwhile: again
                pass
        victim = decoding[worker]
        os.kill(victim.pid, signal.SIGKILL)
        try:
            async for _ in stream:  # it ends, on another worker
                pass
        except openai.APIError as error:
            # No decode worker at that moment (the capacity loop had moved the other away).
            if error.code not in UNDECIDED:
                raise
            return victim, request_id, False
        served += 1
        return victim, request_id, True

    killing = asyncio.create_task(kill_a_worker())
    await asyncio.gather(*(conversation(u) for u in range(USERS)))
    victim, killed, continued = await killing
    await watch.close()
    bus = await Bus.connect(cluster.nats_url, "test-determinism")
    configs: dict[str, PlannerConfigured] = {}
    decisions: dict[str, RouteDecided] = {}
    moves: list[RolesRebalanced] = []

    async def on_config(event: PlannerConfigured, _: int) -> None:
        configs[event.source] = event

    async def on_route(event: RouteDecided, _: int) -> None:
        decisions[f"{event.request_id}/{event.spec.attempt}"] = event  # a move decides anew

    async def on_move(event: RolesRebalanced, _: int) -> None:
        moves.append(event)

    try:
        await bus.replay(Subjects.planner_configured, 0, on_config)
        await bus.replay(Subjects.roles_rebalanced, 0, on_move)
        await bus.replay(Subjects.route_decisions, 0, on_route)
        await eventually(lambda: len(decisions) >= served, timeout=15)
    finally:
        await bus.close()
    # What the run went through.
    assert len(configs) == 2 and {e.source for e in decisions.values()} == set(configs)
    assert moves, "the capacity loop moved no worker"
    assert decisions[f"{killed}/0"].worker_id == victim.worker_id
    if continued:
        assert decisions[f"{killed}/1"].worker_id != victim.worker_id
    assert any(c.owns_session for e in decisions.values() for c in e.candidates)
    placements = [e.prefill for e in decisions.values() if e.prefill is not None]
    assert any(p.prefill_worker_id for p in placements), [p.reason for p in placements]
    assert any(p.prefill_worker_id is None for p in placements)
    # And every decision made again from the log alone.
    moved = {}
    for request_id, event in decisions.items():
        policy, disagg = settings_of(configs[event.source])
        diff = differences(event, redecide(event, policy, disagg))
        if diff:
            moved[request_id] = diff
    assert moved == {}
