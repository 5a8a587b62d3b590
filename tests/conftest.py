"""Real parts: every test session starts its own nats-server (JetStream) and etcd on free ports,
with temporary data dirs; cluster tests run every service as its own OS process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from bus.client import Bus
from infra.cluster import ClusterConfig, LocalCluster
from infra.embedded import EmbeddedServer, free_port, start_etcd, start_nats

# Fast, deterministic workers for the end-to-end tests: 1 ms per decode step.
FAST_WORKERS = {
    "LANEWAY_TIMING": "fixed",
    "LANEWAY_LEASE_TTL_S": "2",
    "LANEWAY_LOAD_REPORT_INTERVAL_S": "0.2",
    "LANEWAY_DRAIN_TIMEOUT_S": "1",
}


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedServer) -> AsyncIterator[Bus]:
    client = await Bus.connect(nats_server.url, "test")
    await client.ensure_streams()
    yield client
    await client.close()


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterFactory]:
    """Start clusters with their own NATS and etcd (no state shared between tests)."""
    started: list[LocalCluster] = []

    def make(workers: int = 2, env: dict[str, str] | None = None, **kwargs: object) -> LocalCluster:
        state: Path = tmp_path_factory.mktemp("cluster")
        cluster = LocalCluster(
            ClusterConfig(
                state_dir=state,
                http_port=free_port(),
                workers=workers,
                env={**FAST_WORKERS, **(env or {})},
                **kwargs,  # type: ignore[arg-type]
            )
        )
        started.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
