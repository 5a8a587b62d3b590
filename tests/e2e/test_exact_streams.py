"""Every stream whole under load: seeded streamed completions through 4 sim workers, many at a
time, each compared byte for byte, and its usage, with the unstreamed answer for its seed."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from infra.cluster import LocalCluster
from tests.e2e.exact import MAX_TOKENS, SEEDS, answers, mismatch, stream
from tests.live import ClusterFactory


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=4)


async def replay_streams(cluster: LocalCluster, count: int, concurrency: int) -> None:
    rng = random.Random(13)
    plan = [(rng.randrange(SEEDS), rng.randint(1, MAX_TOKENS)) for _ in range(count)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url,
        headers=cluster.api_headers,
        timeout=30.0,
        limits=limits,
    ) as http:
        whole = await answers(http)
        gate = asyncio.Semaphore(concurrency)

        async def one(seed: int, max_tokens: int) -> str | None:
            async with gate:
                return mismatch(await stream(http, seed, max_tokens), whole[seed])

        started = time.perf_counter()
        found = await asyncio.gather(*(one(seed, n) for seed, n in plan))
        elapsed = time.perf_counter() - started
    wrong = [m for m in found if m is not None]
    assert not wrong, f"{len(wrong)} of {count} streams differ ({elapsed:.1f} s): {wrong[:5]}"


async def test_hundreds_of_concurrent_streams_are_exact(cluster: LocalCluster) -> None:
    await replay_streams(cluster, count=500, concurrency=32)


@pytest.mark.slow
async def test_thousands_of_concurrent_streams_are_exact(cluster: LocalCluster) -> None:
    await replay_streams(cluster, count=3000, concurrency=64)
