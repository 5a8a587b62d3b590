"""The metrics port every service opens: Prometheus text at /metrics, /healthz while the process
answers, /readyz only once every readiness check passes (and naming those that fail)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from infra.ports import free_port
from observability.metrics import MetricsServer


async def test_metrics_health_and_readiness() -> None:
    registry = CollectorRegistry()
    Counter("laneway_test_things", "Things.", registry=registry).inc(3)
    server = MetricsServer(registry)
    port = free_port()
    await server.start("127.0.0.1", port)
    connected = False
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200
            assert "laneway_test_things_total 3.0" in metrics.text
            assert metrics.headers["content-type"].startswith("text/plain; version=")
            assert (await client.get("/healthz")).status_code == 200
            # Before any check is added the service is still starting.
            starting = await client.get("/readyz")
            assert (starting.status_code, starting.text) == (503, "not ready: starting\n")
            server.ready_when("bus", lambda: connected)
            server.ready_when("lease", lambda: True)
            failing = await client.get("/readyz")
            assert (failing.status_code, failing.text) == (503, "not ready: bus\n")
            connected = True
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.get("/readyz?verbose")).status_code == 200
            assert (await client.get("/nothing")).status_code == 404
            assert (await client.post("/metrics")).status_code == 405
    finally:
        await server.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)


async def test_port_zero_serves_nothing_and_a_taken_port_is_one_line() -> None:
    idle = MetricsServer(CollectorRegistry())
    await idle.start("127.0.0.1", 0)
    assert idle.port == 0
    await idle.close()
    first = MetricsServer(CollectorRegistry())
    port = free_port()
    await first.start("127.0.0.1", port)
    try:
        with pytest.raises(OSError, match=f"cannot listen for metrics on 127.0.0.1:{port}"):
            await MetricsServer(CollectorRegistry()).start("127.0.0.1", port)
    finally:
        await first.close()
