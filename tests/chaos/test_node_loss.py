"""Node loss under load (``make chaos``): a steady stream of streamed completions through the real
services on a 3-node JetStream cluster and a 3-member etcd cluster, while one NATS node is killed
and later brought back, then the etcd leader. No request may fail, every stream must be exact
(byte for byte the unstreamed answer for its seed: no token lost or repeated), and no worker may
drop out of etcd's view (which is what the planner declares lost). The pause each fault causes is
printed: the longest wait for a token (or a first token) that spans it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import pytest

from bus.registry import connect_etcd, watch_workers
from infra.cluster import LocalCluster
from infra.embedded import EmbeddedServer
from schemas.messages import WorkerRegistration
from tests.e2e.exact import (
    MAX_TOKENS,
    SEEDS,
    Streamed,
    answers,
    mismatch,
    stream_body,
)
from tests.ingress.helpers import sse_data
from tests.live import ClusterFactory, registrations

pytestmark = [pytest.mark.chaos, pytest.mark.live, pytest.mark.timeout(300)]

LOAD_S = 60.0
RATE_PER_S = 4.0
# 20 ms a decode step: a stream of up to 48 tokens lasts about a second, so some are always
# in flight when a node goes.
SLOW_SIM = {"LANEWAY_PERF_MODEL": "fixed", "LANEWAY_SPEEDUP": "0.05", "LANEWAY_LEASE_TTL_S": "5"}
# Seconds into the load: (what, when).
NATS_KILL, NATS_BACK, ETCD_KILL, ETCD_BACK = 10.0, 25.0, 32.0, 47.0
# A fault's pause is looked for in the waits that begin within this many seconds of it.
WINDOW_S = 8.0


@dataclass
class Timed:
    """One stream as the client saw it: when it was sent and when each chunk came."""

    streamed: Streamed
    sent: float
    chunks: list[float] = field(default_factory=list)

    def waits(self) -> list[tuple[float, float]]:
        """(start, length) of each wait: for the first chunk, then between chunks."""
        times = [self.sent, *self.chunks]
        return [(a, b - a) for a, b in itertools.pairwise(times)]


async def timed_stream(http: httpx.AsyncClient, seed: int, max_tokens: int) -> Timed:
    sent = time.monotonic()
    chunks: list[float] = []
    raw: list[str] = []
    try:
        async with http.stream(
            "POST", "/completions", json=stream_body(seed, max_tokens)
        ) as response:
            async for text in response.aiter_text():
                chunks.append(time.monotonic())
                raw.append(text)
            status = response.status_code
    except httpx.HTTPError as exc:
        return Timed(Streamed(seed, max_tokens, 0, [repr(exc)]), sent, chunks)
    data = "".join(raw)
    events = sse_data(data) if status == 200 else [data]
    return Timed(Streamed(seed, max_tokens, status, events), sent, chunks)


async def etcd_leader(members: list[EmbeddedServer]) -> EmbeddedServer:
    client = connect_etcd(",".join(m.url for m in members))
    try:
        leader = (await client.status()).leader
    finally:
        await client.close()
    url = leader.client_urls[0].removeprefix("http://")
    return next(m for m in members if m.url == url)


def pause(timed: list[Timed], at: float) -> tuple[float, str]:
    """The longest wait that spans ``at`` or begins within the window after it, and whether it
    was for a first token or between two."""
    waits = [
        (length, "first token" if i == 0 else "between tokens")
        for t in timed
        for i, (start, length) in enumerate(t.waits())
        if at - length <= start <= at + WINDOW_S
    ]
    return max(waits, default=(0.0, "none"))


# (seconds into the load, what, doing it)
Fault = tuple[float, str, Callable[[], Awaitable[None]]]


async def test_load_survives_a_nats_node_and_the_etcd_leader(
    cluster_factory: ClusterFactory,
) -> None:
    cluster: LocalCluster = cluster_factory(workers=2, ha=True, env=SLOW_SIM)
    nats, etcd = _servers(cluster, "nats"), _servers(cluster, "etcd")
    victims: list[EmbeddedServer] = []

    async def kill_etcd_leader() -> None:
        victims.append(await etcd_leader(etcd))
        victims[0].kill()

    # Killed and started from this (the main) thread, which the servers' die-with-parent
    # signal is tied to; a kill or a spawn does not block it long.
    await under_load(
        cluster,
        [
            (NATS_KILL, "nats node killed", _sync(nats[0].kill)),
            (NATS_BACK, "nats node back", _sync(nats[0].respawn)),
            (ETCD_KILL, "etcd leader killed", kill_etcd_leader),
            (ETCD_BACK, "etcd member back", _sync(lambda: victims[0].respawn())),
        ],
    )


async def test_load_survives_a_nats_node_that_stops_answering(
    cluster_factory: ClusterFactory,
) -> None:
    """A partition's stand-in: the node is up, its connections open, but it answers nothing."""
    cluster: LocalCluster = cluster_factory(workers=2, ha=True, env=SLOW_SIM)
    node = _servers(cluster, "nats")[0]
    await under_load(
        cluster,
        [
            (NATS_KILL, "nats node frozen", _sync(lambda: node.proc.send_signal(signal.SIGSTOP))),
            (NATS_BACK, "nats node thawed", _sync(lambda: node.proc.send_signal(signal.SIGCONT))),
        ],
        load_s=NATS_BACK + 10,
    )


async def under_load(cluster: LocalCluster, plan: list[Fault], load_s: float = LOAD_S) -> None:
    """Stream ``RATE_PER_S`` requests a second for ``load_s`` while ``plan`` happens; then
    print each fault's pause and check every stream and etcd's view of the workers."""
    workers = set(await registrations(cluster.etcd_endpoints))
    views: list[set[str]] = []

    async def on_change(found: dict[str, WorkerRegistration]) -> None:
        views.append(set(found))

    watcher_client = connect_etcd(cluster.etcd_endpoints)
    watcher = asyncio.create_task(watch_workers(watcher_client, on_change))
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url,
        headers=cluster.api_headers,
        timeout=60.0,
        limits=limits,
    ) as http:
        whole = await answers(http)
        start = time.monotonic()
        faults: dict[str, float] = {}

        async def faulting() -> None:
            for offset, what, act in plan:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                faults[what] = time.monotonic()
                await act()

        schedule = asyncio.create_task(faulting())
        sending = []
        for i in range(int(load_s * RATE_PER_S)):
            await asyncio.sleep(max(0.0, start + i / RATE_PER_S - time.monotonic()))
            seed, n = rng.randrange(SEEDS), rng.randint(1, MAX_TOKENS)
            sending.append(asyncio.create_task(timed_stream(http, seed, n)))
        timed = await asyncio.gather(*sending)
        await schedule
    watcher.cancel()
    await watcher_client.close()

    first = start + plan[0][0]
    before = [length for t in timed for s, length in t.waits() if s < first - 1]
    print(f"\nbaseline: longest wait before any fault {max(before, default=0.0) * 1000:.0f} ms")
    for what, when in faults.items():
        length, kind = pause(timed, when)
        print(f"{what} at {when - start:5.1f} s: pause {length * 1000:.0f} ms ({kind})")
    wrong = [m for t in timed if (m := mismatch(t.streamed, whole[t.streamed.seed]))]
    assert not wrong, f"{len(wrong)} of {len(timed)} requests failed or differ: {wrong[:5]}"
    lost = [sorted(workers - view) for view in views if not workers <= view]
    assert not lost, f"workers dropped out of etcd's view: {lost[:5]}"


def _servers(cluster: LocalCluster, kind: str) -> list[EmbeddedServer]:
    found = [s for s in cluster.servers if s.name.startswith(kind)]
    assert len(found) == 3
    return found


def _sync(call: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        call()

    return run
