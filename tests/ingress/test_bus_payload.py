"""A request the engines could hold but the message bus cannot carry is the client's to fix: a
clean invalid-request failure, not a 500 (against a real nats-server with a small payload limit)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bus.client import Bus
from bus.provision import ensure_streams
from infra.cluster_auth import ClusterAuth
from schemas.events import RequestFailed, RequestSpec, SamplingParams
from services.ingress.nats_gateway import NatsGateway
from tests.live import admin_nats

pytestmark = pytest.mark.live  # starts a nats-server of its own


async def test_a_request_larger_than_the_bus_carries_fails_as_invalid(tmp_path: Path) -> None:
    server = admin_nats(ClusterAuth(tmp_path / "auth", []), tmp_path, max_payload=64 * 1024)
    bus = await Bus.connect(server.url, "test-payload")
    try:
        await ensure_streams(bus.js)
        gateway = NatsGateway(bus, "ingress-test")
        await gateway.start()
        spec = RequestSpec(
            model="m",
            prompt_token_ids=(65,) * 50_000,
            block_size=16,
            block_hashes=(),
            sampling=SamplingParams(max_tokens=1),
            reply_to="ingress-test",
            deadline=datetime.now(UTC) + timedelta(minutes=1),
        )
        events = [event async for event in gateway.submit("r1", None, spec)]
    finally:
        await bus.close()
        server.stop()
    assert len(events) == 1 and isinstance(events[0], RequestFailed)
    assert events[0].code == "invalid_request"
    assert "65,536" in events[0].message
