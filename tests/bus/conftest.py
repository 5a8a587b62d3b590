"""The bus's tests run on both of its servers: a real nats-server, and the in-memory broker
(bus.memory) that service-logic tests use. A test of what only a real server does (limits,
clustering, the JetStream API itself) is marked ``nats_only``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bus.client import Bus
from bus.memory import MemoryBroker
from bus.provision import ensure_streams
from tests.bus.servers import Connect


@pytest.fixture(params=["nats", "memory"])
def connect_bus(request: pytest.FixtureRequest) -> Connect:
    """A connection to the test's server, with the topology's streams: the test's own, a
    replica's, a second service's."""
    if request.param == "memory":
        marker = request.node.get_closest_marker("nats_only")
        if marker is not None:
            pytest.skip(f"a real server's: {marker.args[0]}")
        broker = MemoryBroker()

        async def in_memory(name: str) -> Bus:
            return broker.connect(name)

        return in_memory
    url = request.getfixturevalue("nats_server").url

    async def to_nats(name: str) -> Bus:
        client = await Bus.connect(url, name)
        await ensure_streams(client.js)  # the in-memory broker has the topology's already
        return client

    return to_nats


@pytest.fixture
async def bus(connect_bus: Connect) -> AsyncIterator[Bus]:
    client = await connect_bus("test")
    yield client
    await client.close()
