"""Each service's metrics port (``LANEWAY_METRICS_PORT``; 0: none): ``/metrics`` in Prometheus'
text format, ``/healthz`` (the process answers: Kubernetes' liveness) and ``/readyz`` (every
readiness check passes: Kubernetes' readiness), served on the service's own event loop so that a
scrape costs the serving path nothing between scrapes.

A tiny HTTP/1.1 server rather than a second web framework: three GET paths, one answer per
connection, which is all Prometheus and the kubelet ask for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# A request head larger than this, or slower than the timeout, is dropped: no probe sends one.
_MAX_HEAD_BYTES = 8192
_HEAD_TIMEOUT_S = 5.0

ReadyCheck = Callable[[], bool]


class MetricsServer:
    """``registry``'s metrics and the probes. Readiness checks are named, so that ``/readyz``
    says which one fails."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._checks: dict[str, ReadyCheck] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    def ready_when(self, name: str, check: ReadyCheck) -> None:
        self._checks[name] = check

    def not_ready(self) -> list[str]:
        """The names of the checks that fail now; empty when ready (and before any is added
        the service is still starting: not ready)."""
        if not self._checks:
            return ["starting"]
        return [name for name, check in self._checks.items() if not check()]

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; port 0 serves nothing (the metrics stay in the registry)."""
        if port == 0:
            return
        try:
            self._server = await asyncio.start_server(self._answer, host, port)
        except OSError as exc:
            raise OSError(f"cannot listen for metrics on {host}:{port}: {exc.strerror}") from None
        self.port = port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
            status, content_type, body = self._route(head[:_MAX_HEAD_BYTES])
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a client that went away or never finished asking gets nothing
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _route(self, head: bytes) -> tuple[str, str, bytes]:
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        if method != b"GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == b"/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == b"/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == b"/readyz":
            failing = self.not_ready()
            if failing:
                text = "not ready: " + ", ".join(failing) + "\n"
                return "503 Service Unavailable", "text/plain", text.encode()
            return "200 OK", "text/plain", b"ready\n"
        return "404 Not Found", "text/plain", b"/metrics, /healthz or /readyz\n"
