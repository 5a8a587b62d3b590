"""A worker that goes mid-stream: its unfinished requests continue on another worker, and every
stream is still byte for byte the unstreamed answer for its seed (no token lost or repeated),
with a ``migrated`` routing decision recorded for each move. Killed outright, or restarted one by
one with SIGTERM (each drains, hands the rest on, exits); past LANEWAY_MIGRATION_LIMIT the stream
ends with a clear error instead. A worker stopped (SIGSTOP) past its lease is given up on the
same way; the 10-second stop of the issue runs in ``make chaos`` (tests/chaos/test_faults.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx

from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import Event, RouteDecided
from schemas.messages import WorkerRegistration
from tests.e2e.exact import MAX_TOKENS, Streamed, answers, mismatch, stream, stream_body
from tests.e2e.moves import observe_moves
from tests.helpers import eventually
from tests.ingress.helpers import sse_data
from tests.live import ClusterFactory, registrations

# A 48-token answer streams for about two seconds.
SLOW = {"LANEWAY_SPEEDUP": "0.1"}
STREAMS = 12


async def under_fault(
    cluster: LocalCluster, fault: Callable[[], Awaitable[None]]
) -> tuple[list[Streamed], dict[int, str]]:
    """Streams ``STREAMS`` seeded completions, runs ``fault`` while they are in flight; what
    each client got, and the unstreamed answers to compare them with."""
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=60
    ) as http:
        whole = await answers(http, STREAMS)
        streams = [asyncio.create_task(stream(http, seed, MAX_TOKENS)) for seed in range(STREAMS)]
        await asyncio.sleep(0.5)
        await fault()
        return list(await asyncio.gather(*streams)), whole


async def planner_migrations(cluster: LocalCluster) -> float:
    """What the planner's metrics say it migrated."""
    (planner,) = [s for s in cluster.services if s.name == "planner"]
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{planner.metrics_port}/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("laneway_planner_migrations_total ")]
    return float(line.split()[1])


async def test_a_killed_workers_streams_continue_exactly_on_the_other(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, env=SLOW)
    bus, moves = await observe_moves(cluster)
    workers = await registrations(cluster.etcd_endpoints)
    killed: list[WorkerRegistration] = []

    async def kill() -> None:
        killed.append(await moves.victim(workers))
        os.kill(killed[0].pid, signal.SIGKILL)

    streamed, whole = await under_fault(cluster, kill)
    [victim] = killed
    assert [m for s in streamed if (m := mismatch(s, whole[s.seed]))] == []
    await eventually(lambda: moves.routes, timeout=2)
    assert {r.worker_id for r in moves.routes} == set(workers) - {victim.worker_id}
    assert all(r.spec.attempt == 1 and r.spec.sampling.offset > 0 for r in moves.routes)
    assert await planner_migrations(cluster) == len(moves.routes)
    await bus.close()


async def test_a_stopped_workers_streams_continue_on_the_other(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, env=SLOW)
    bus, moves = await observe_moves(cluster)
    workers = await registrations(cluster.etcd_endpoints)
    stopped: list[WorkerRegistration] = []

    async def pause() -> None:
        # Past its lease (2 s): the planner gives its requests up; back, it must not disturb
        # the streams that moved away from it.
        stopped.append(await moves.victim(workers))
        os.kill(stopped[0].pid, signal.SIGSTOP)
        await asyncio.sleep(4)
        os.kill(stopped[0].pid, signal.SIGCONT)

    streamed, whole = await under_fault(cluster, pause)
    [victim] = stopped
    assert [m for s in streamed if (m := mismatch(s, whole[s.seed]))] == []
    assert moves.routes and {r.worker_id for r in moves.routes} == set(workers) - {victim.worker_id}
    await bus.close()


async def test_a_rolling_restart_fails_no_stream(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2, env={**SLOW, "LANEWAY_DRAIN_TIMEOUT_S": "0.5"})
    bus, moves = await observe_moves(cluster)
    workers = [s for s in cluster.services if "worker" in s.name]
    assert len(workers) == 2

    async def restart_each() -> None:
        for service in workers:
            assert service.proc is not None
            service.proc.send_signal(signal.SIGTERM)
            # It drains (half a second), hands its unfinished requests on, and exits.
            await asyncio.wait_for(asyncio.to_thread(service.proc.wait), 10)
            cluster.spawn(service)
            worker_id = service.env["LANEWAY_WORKER_ID"]
            await eventually(partial(_registered, cluster, worker_id), timeout=15)

    streamed, whole = await under_fault(cluster, restart_each)
    assert [m for s in streamed if (m := mismatch(s, whole[s.seed]))] == []
    assert moves.routes, "no request was in flight on a restarted worker"
    await bus.close()


async def test_past_the_migration_limit_the_stream_ends_with_a_clear_error(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, env={**SLOW, "LANEWAY_MIGRATION_LIMIT": "0"})
    bus, moves = await observe_moves(cluster)
    workers = await registrations(cluster.etcd_endpoints)

    async def kill() -> None:
        os.kill((await moves.victim(workers)).pid, signal.SIGKILL)

    streamed, whole = await under_fault(cluster, kill)
    await bus.close()
    failed = [s for s in streamed if mismatch(s, whole[s.seed])]
    assert failed
    for s in failed:
        # Committed to a 200 stream, it ends with an error event and no [DONE].
        assert s.status == 200 and s.events[-1:] != ["[DONE]"]
        error = s.events[-1]
        assert isinstance(error, dict) and "LANEWAY_MIGRATION_LIMIT" in str(error)


# 97 tokens (the sim's are bytes): six blocks of 16 and one token. A continued prompt one block
# longer than that, which its new worker holds cached, has more tokens cached than this prompt has.
USAGE_PROMPT = "a story, " * 9 + "once upon a time"
COPIES = 6


async def test_a_migrated_requests_usage_counts_the_clients_prompt(
    cluster_factory: ClusterFactory,
) -> None:
    """Copies of one seeded request run on both workers at once (the same answer, so the same
    blocks cached on each); the worker of some is killed past their first block of answer, and
    they continue on the other, which finds their continued prompt (the client's and the answer
    so far) cached beyond the client's prompt. Their usage counts the client's prompt: all of
    it cached, never more (an access log once showed 144 cached of 98)."""
    cluster = cluster_factory(workers=2, env=SLOW)
    assert len(USAGE_PROMPT) % 16 == 1
    bus, moves = await observe_moves(cluster)
    placed: dict[str, str] = {}

    async def on_route(event: Event) -> None:
        if isinstance(event, RouteDecided) and event.request_id and not event.spec.attempt:
            placed[event.request_id] = event.worker_id

    await bus.subscribe(Subjects.route_decisions, on_route)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=60
    ) as http:
        body = {
            **stream_body(seed=7, max_tokens=MAX_TOKENS),
            "prompt": USAGE_PROMPT,
        }
        streams = [asyncio.create_task(_sse(http, body)) for _ in range(COPIES)]
        await eventually(lambda: len(placed) == COPIES, timeout=10)
        on = Counter(placed.values())
        assert len(on) == 2, f"every copy went to one worker: {on}"
        # Past 16 of the 48 tokens (about 2 s for all of them) on the one killed.
        await asyncio.sleep(1.2)
        victim = min(on, key=lambda w: (on[w], w))
        workers = await registrations(cluster.etcd_endpoints)
        os.kill(workers[victim].pid, signal.SIGKILL)
        streamed = await asyncio.gather(*streams)
    await bus.close()
    texts = {text for text, _ in streamed}
    assert len(texts) == 1 and len(next(iter(texts))) == MAX_TOKENS, texts  # exact, as one
    moved = [r for r in moves.routes if r.spec.attempt == 1]
    assert len(moved) == on[victim]
    # Each continued past the client's prompt by more than its last, partial block: its new
    # worker found more tokens cached than the client's prompt has.
    assert all(len(r.spec.prompt_token_ids) > len(USAGE_PROMPT) + 16 for r in moved), moved
    usages = [usage for _, usage in streamed]
    assert all(u["prompt_tokens"] == len(USAGE_PROMPT) for u in usages), usages
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert all(c <= len(USAGE_PROMPT) for c in cached), cached


async def _sse(http: httpx.AsyncClient, body: dict[str, object]) -> tuple[str, dict[str, Any]]:
    """A streamed completion's text and usage."""
    reply = await http.post("/completions", json=body)
    assert reply.status_code == 200, reply.text
    chunks = [e for e in sse_data(reply.text) if isinstance(e, dict)]
    text = "".join(c["text"] for chunk in chunks for c in chunk["choices"])
    return text, chunks[-1]["usage"]


async def _registered(cluster: LocalCluster, worker_id: str) -> bool:
    return worker_id in await registrations(cluster.etcd_endpoints)
