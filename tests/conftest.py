"""Real parts: every test session starts its own nats-server (JetStream) and etcd on free ports,
with temporary data dirs; cluster tests run every service as its own OS process.

A test that uses those servers is marked ``live`` here, whatever fixture chain brings them in,
so ``pytest -m "not live"`` runs the pure tests alone; one that starts processes of its own
(``laneway``, a service, a server binary) says ``live`` itself.

``slow``, ``gpu`` and ``chaos`` tests run only when the ``-m`` expression names them (``-m gpu``,
``-m "slow and not live"``): a ``-m`` given on the command line replaces the one in ``addopts``,
so their opt-in cannot live there."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.client import Bus
from bus.memory import MemoryBroker
from bus.provision import ensure_streams
from infra.cluster import LocalCluster
from infra.cluster_auth import ClusterAuth, secure
from infra.cluster_plan import ClusterConfig
from infra.embedded import EmbeddedServer, start_etcd, start_nats
from infra.ports import free_port, unephemeral_ports
from services.engine.vllm_engine.compat import hide_broken
from tests.live import FAST_WORKERS, ClusterFactory, admin_etcd

# The fixtures that start real servers; a test using any of them, directly or through another
# fixture, is live.
SERVER_FIXTURES = frozenset({"nats_server", "etcd_server", "cluster_factory"})
OPT_IN_MARKERS = ("slow", "gpu", "chaos")
# A test using any of them loads vLLM engines (marked ``vllm``).
VLLM_FIXTURES = {"vllm_model", "vllm_pool"}


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's CPU wheel brings media packages that cannot load beside its torch, and transformers
    # (the tests' reference for the tiny model) imports them where installed.
    hide_broken()
    # xdist's workers start clusters side by side. Each picks its servers' ports from a slice of
    # its own (the clusters' own processes inherit it), or two workers could pick the same free
    # port and race to bind it.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    ports = unephemeral_ports()
    if worker and ports is not None and "LANEWAY_PORT_RANGE" not in os.environ:
        size = len(ports) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        low = ports.start + int(worker.removeprefix("gw")) * size
        os.environ["LANEWAY_PORT_RANGE"] = f"{low}-{low + size - 1}"


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection sees the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if SERVER_FIXTURES & fixtures:
            item.add_marker(pytest.mark.live)
        if VLLM_FIXTURES & fixtures:
            item.add_marker(pytest.mark.vllm)
    expression = config.getoption("markexpr") or ""
    excluded = [m for m in OPT_IN_MARKERS if not re.search(rf"\b{m}\b", expression)]
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        opted_out = any(item.get_closest_marker(m) for m in excluded)
        (dropped if opted_out else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def made_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `laneway make-tiny-model` writes, with its trained tokenizer."""
    from services.engine.torch_engine.tiny import make_tiny_model  # torch: only where used

    directory = tmp_path_factory.mktemp("product-tiny")
    make_tiny_model(directory)
    return directory


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM tests' checkpoint: `laneway make-tiny-model`'s, made decisive
    (tests/decisive_model.py)."""
    from tests.decisive_model import make_decisive_model  # torch: only where used

    directory = tmp_path_factory.mktemp("decisive-tiny")
    make_decisive_model(directory)
    return directory


@pytest.fixture(scope="session")
def bus_auth(tmp_path_factory: pytest.TempPathFactory) -> ClusterAuth:
    """The session servers' users: the admin alone, whose credentials their ``url`` carries, so
    that every test talks to servers that refuse anonymous clients."""
    return ClusterAuth(tmp_path_factory.mktemp("auth"), [])


@pytest.fixture(scope="session")
def nats_server(
    tmp_path_factory: pytest.TempPathFactory, bus_auth: ClusterAuth
) -> Iterator[EmbeddedServer]:
    server = start_nats(
        tmp_path_factory.mktemp("nats"), authorization=bus_auth.nats_authorization()
    )
    server.url = bus_auth.admin("nats").within(server.url)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(
    tmp_path_factory: pytest.TempPathFactory, bus_auth: ClusterAuth
) -> Iterator[EmbeddedServer]:
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        server.url = secure(bus_auth, "", server.url, 1, nats=False, etcd=True)[1]
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """An etcd of the test's own, auth on (its ``url`` carries the admin's credentials: a client
    that found etcd gone logs in again once it is back), for a test that kills and restarts it."""
    server = admin_etcd(ClusterAuth(tmp_path / "auth", []), tmp_path, tmp_path / "etcd.log")
    yield server
    server.stop()


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    """A bus on an in-memory broker of its own (bus.memory): for service logic that needs the
    bus's behaviour, not a server's (``nats_bus``)."""
    client = MemoryBroker().connect("test")
    yield client
    await client.close()


@pytest.fixture
async def nats_bus(nats_server: EmbeddedServer) -> AsyncIterator[Bus]:
    """A bus on the session's nats-server, its streams made."""
    client = await Bus.connect(nats_server.url, "test")
    await ensure_streams(client.js)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFactory]:
    """Start clusters with their own NATS and etcd (no state shared between tests). Their API
    takes keys, as `laneway up`'s does: clients send ``cluster.api_key`` (``api_auth=False`` for
    a test of the API without them). ``start_timeout``: for workers that load a real model
    (a vLLM worker takes 15-40 s on 2 cores)."""
    started: list[LocalCluster] = []

    def make(
        workers: int = 2,
        env: dict[str, str] | None = None,
        api_auth: bool = True,
        start_timeout: float = 60.0,
        **kwargs: object,
    ) -> LocalCluster:
        state: Path = tmp_path_factory.mktemp("cluster")
        cluster = LocalCluster(
            ClusterConfig(
                state_dir=state,
                http_port=free_port(),
                workers=workers,
                env={**FAST_WORKERS, **(env or {})},
                api_auth=api_auth,
                **kwargs,  # type: ignore[arg-type]
            )
        )
        started.append(cluster)
        cluster.start(start_timeout)
        return cluster

    yield make
    for cluster in started:
        cluster.stop()


# ../shared beside the checkout, as the project keeps its traces out of the repo.
SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """A Mooncake-format trace of three conversations, each turn extending the last."""
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    next_id = 0
    for conv in range(3):
        ids: list[int] = []
        for turn in range(4):
            new = list(range(next_id, next_id + rng.randint(1, 3)))
            next_id += len(new)
            ids += new
            rows.append(
                {
                    "timestamp": conv * 700 + turn * 2000,
                    "input_length": len(ids) * 512 - rng.randint(0, 300),
                    "output_length": rng.randint(5, 40),
                    "hash_ids": list(ids),
                }
            )
    rows.sort(key=lambda r: r["timestamp"])
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def mooncake_trace() -> Path:
    path = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path
