"""A live worker over a sim engine, and what it publishes to one ingress."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from bus.client import Bus
from bus.registry import LeasedKey, connect_etcd
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.events import Event, RequestSpec, RouteDecided, SamplingParams
from services.common.tokenizer import ByteTokenizer
from services.engine.sim import SimEngine
from services.worker.runtime import Worker
from services.worker.settings import WorkerOptions
from tests.helpers import routed

INGRESS = "testingress"


def route(
    request_id: str, worker_id: str, max_tokens: int = 3, stop: tuple[str, ...] = ()
) -> RouteDecided:
    """A decision to run a 40-token prompt on ``worker_id``, answered to :data:`INGRESS`."""
    spec = RequestSpec(
        model="m",
        prompt_token_ids=tuple(range(40)),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=max_tokens, stop=stop, seed=7),
        reply_to=INGRESS,
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
    )
    return routed(request_id, worker_id, spec)


@contextlib.asynccontextmanager
async def worker_publishing(
    bus: Bus, etcd_server: EmbeddedServer, engine: SimEngine, name: str
) -> AsyncIterator[list[Event]]:
    """A worker ``name`` on ``engine`` (one modelled second a second), publishing every token
    batch and terminal to :data:`INGRESS`: the list they are collected in."""
    options = WorkerOptions(name, "both", "sim", "m", 1.0, 5, 1.0, 1.0)
    worker = Worker(bus, engine, ByteTokenizer(), options)
    etcd = connect_etcd(etcd_server.url)
    stop = asyncio.Event()
    running = asyncio.create_task(
        worker.run(LeasedKey.worker(etcd, worker.registration(), 5), stop)
    )
    published: list[Event] = []

    async def collect(event: Event) -> None:
        published.append(event)

    await bus.subscribe(Subjects.request_terminal(INGRESS), collect)
    await bus.subscribe(Subjects.tokens(INGRESS), collect)
    await asyncio.sleep(0.5)
    try:
        yield published
    finally:
        stop.set()
        await running
        await etcd.close()
