"""Ingress process: the OpenAI HTTP API in front of the bus."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path

import uvicorn
from pydantic import Field
from starlette.types import ASGIApp

from bus.adapters import add_adapter, remove_adapter, watch_adapters
from bus.api_keys import watch_keys
from bus.client import Bus
from bus.permissions import durable_step_downs, leader_step_downs
from bus.registry import connect_etcd, watch_workers
from bus.runtime import run_service
from bus.settings import ServiceSettings
from bus.topology import Subjects
from observability.metrics import MetricsServer
from observability.tracing import setup_tracing
from schemas.events import WorkerLoadReported, new_id
from schemas.messages import WorkerRegistration
from services.common.hf_tokenizer import HfTokenizer
from services.common.liveness import Liveness
from services.common.tokenizer import ByteTokenizer, Tokenizer
from services.ingress.acceptor import EagerAcceptServer
from services.ingress.adapters import AdapterEndpoints, Adapters
from services.ingress.admission import Admission, AdmissionSettings
from services.ingress.api import create_app
from services.ingress.auth import KeyBook
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.follow import Recovery
from services.ingress.health import Readiness
from services.ingress.http_head import HeadLimits, bounded_head_protocol
from services.ingress.metrics import IngressMetrics
from services.ingress.migration import MIGRATION_LIMIT
from services.ingress.nats_gateway import NatsGateway
from services.ingress.pool_admission import PooledAdmission
from services.ingress.settings import IngressApiSettings
from services.ingress.shared_limits import TenantGate
from services.ingress.worker_features import WorkerFeatures

# The API settings' defaults, written once there.
_API = IngressApiSettings(instance_id="")
_ADMISSION = AdmissionSettings()
_HEAD = HeadLimits()


class IngressSettings(ServiceSettings):
    instance_id: str = Field(default_factory=new_id)
    host: str = "127.0.0.1"
    port: int = 8000
    # Several ingress processes on one port (SO_REUSEPORT; the kernel spreads connections over
    # them): an event loop is one core at most, and a busy one delays every stream it holds.
    reuse_port: bool = False
    served_model_names: tuple[str, ...] = _API.served_model_names
    # The served model's folder, for its tokenizer and chat template; unset: the sim's bytes.
    model_dir: Path | None = None
    block_size: int = _API.block_size
    max_model_len: int | None = _API.max_model_len
    default_max_tokens: int = _API.default_max_tokens
    request_timeout_s: float = _API.request_timeout_s
    max_body_bytes: int = _API.max_body_bytes
    # Times a request may move to another worker when its own goes (LANEWAY_MIGRATION_LIMIT).
    migration_limit: int = Field(default=MIGRATION_LIMIT, ge=0)
    admission_queue_per_worker: int = _ADMISSION.queue_per_worker
    admission_max_in_flight: int | None = _ADMISSION.max_in_flight
    admission_max_queue: int = _ADMISSION.max_queue
    admission_max_wait_s: float = _ADMISSION.max_wait_s
    admission_retry_after_s: int = _ADMISSION.retry_after_s
    # Fair share between tenants (services.ingress.fair_share): how long a request waits while
    # tenants contend, and how long a tenant counts as active after its last request.
    admission_share_wait_s: float = _ADMISSION.share_wait_s
    admission_share_window_s: float = _ADMISSION.share_window_s
    # Every request but /health needs an API key from etcd (bus.api_keys); laneway up turns it on.
    api_auth: bool = False
    metrics_auth: bool = _API.metrics_auth
    # Both set: the API speaks HTTPS only, with this PEM certificate (chain) and private key.
    api_tls_certfile: Path | None = None
    api_tls_keyfile: Path | None = None
    # An idle client connection is closed after this long. Longer than clients keep idle ones
    # pooled (httpx 5 s, aiohttp 15 s), so that the client closes first: a server closing one
    # just as the client reuses it fails that request ("Server disconnected"), never received.
    keep_alive_s: int = Field(default=75, gt=0)
    # A request's head (request line and headers) is refused with 431 past these, and one not in
    # within header_timeout_s gets 408: before the key is checked (services.ingress.http_head).
    max_header_bytes: int = Field(default=_HEAD.max_bytes, gt=0)
    max_headers: int = Field(default=_HEAD.max_headers, gt=0)
    header_timeout_s: float = Field(default=_HEAD.timeout_s, gt=0)
    # What the unfinished heads of all connections may hold together; past it, 503.
    head_buffer_bytes: int = Field(default=_HEAD.buffer_bytes, gt=0)

    def api(self) -> IngressApiSettings:
        names = {field.name for field in fields(IngressApiSettings)}
        return IngressApiSettings(**self.model_dump(include=names))

    def head_limits(self) -> HeadLimits:
        return HeadLimits(
            self.max_header_bytes, self.max_headers, self.header_timeout_s, self.head_buffer_bytes
        )

    def admission(self) -> AdmissionSettings:
        names = {f"admission_{field.name}": field.name for field in fields(AdmissionSettings)}
        given = self.model_dump(include=set(names))
        return AdmissionSettings(**{names[key]: value for key, value in given.items()})

    def model_post_init(self, context: object) -> None:
        if (self.api_tls_certfile is None) != (self.api_tls_keyfile is None):
            raise ValueError("LANEWAY_API_TLS_CERTFILE and LANEWAY_API_TLS_KEYFILE go together")


def http_config(app: ASGIApp, settings: IngressSettings) -> uvicorn.Config:
    """The API server's settings."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        # httptools, not "auto": a missing httptools fails at start instead of falling back to
        # h11, which costs the ingress a tenth more CPU per request. Its head bounded, as uvicorn
        # reads a head of any size, at any pace, before the app sees the request.
        http=bounded_head_protocol(settings.head_limits()),
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.keep_alive_s,
        ssl_certfile=settings.api_tls_certfile,
        ssl_keyfile=settings.api_tls_keyfile,
    )


# How long requests cancelled at the end of the shutdown grace get to say so.
_ENDING_S = 1.0


class _Server(EagerAcceptServer):
    # The process's own stop event owns SIGINT/SIGTERM; uvicorn must not take them over.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is None:
        return ByteTokenizer()
    return HfTokenizer(model_dir)


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    # Bound here, before anything else, so that a port in use fails at once as one clear error
    # rather than as uvicorn's exit after the bus is up. Not listened on yet: where the port is
    # shared (reuse_port), a listening socket is handed connections at once, and this replica
    # cannot answer them until it has read etcd (the server listens when it starts).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        cause = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OSError(f"cannot listen on {host}:{port}: {cause}") from None
    return sock


async def _until_all(stop: asyncio.Event, awaited: Sequence[Awaitable[object]]) -> bool:
    """Whether every one of ``awaited`` finished before ``stop`` was set."""
    tasks = [asyncio.ensure_future(a) for a in awaited]
    stopping = asyncio.ensure_future(stop.wait())
    try:
        for task in tasks:
            await asyncio.wait([task, stopping], return_when=FIRST_COMPLETED)
            if not task.done():
                return False
        return True
    finally:
        stopping.cancel()
        for task in tasks:
            task.cancel()


def main() -> None:
    settings = IngressSettings()

    async def serve(stop: asyncio.Event) -> None:
        listener = _bind(settings.host, settings.port, settings.reuse_port)
        setup_tracing("laneway-ingress", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(
            settings.nats_url,
            f"ingress-{settings.instance_id}",
            steps_down=leader_step_downs("ingress"),
            durables_step_down=durable_step_downs("ingress"),
        )
        await bus.provision(settings.stream_replicas, settings.bus_provisioned)
        # Which workers are live, for /health and admission alike (the planner's rule), and
        # whose reports come late: their streams move on when they fall silent.
        liveness = Liveness()
        bus.asks_unless(liveness.behind)
        gateway = NatsGateway(
            bus,
            settings.instance_id,
            Recovery(migration_limit=settings.migration_limit),
            late=liveness.late,
            unheard=liveness.quiet,
        )
        metrics = IngressMetrics()
        await gateway.start(metrics.loop_late.observe)
        etcd = connect_etcd(settings.etcd_endpoints)
        limit = WorkerContextLimit()
        features = WorkerFeatures()
        readiness = Readiness(lambda: bus.nc.is_connected, liveness)
        admission = PooledAdmission(
            metrics,
            lambda: Admission(
                settings.admission(),
                metrics,
                pressure=gateway.behind,
                liveness=liveness,
            ),
        )

        workers_read = asyncio.Event()

        async def on_workers(workers: dict[str, WorkerRegistration]) -> None:
            liveness.registered(workers)
            await limit.on_workers(workers)
            await features.on_workers(workers)
            await admission.on_workers(workers)
            workers_read.set()

        watching = [
            asyncio.create_task(watch_workers(etcd, on_workers), name="worker-watch"),
            asyncio.create_task(readiness.watch_planners(etcd), name="planner-watch"),
        ]
        adapters = Adapters()
        watching.append(
            asyncio.create_task(watch_adapters(etcd, adapters.on_adapters), name="adapter-watch")
        )
        keys = KeyBook(TenantGate(settings.instance_id, etcd)) if settings.api_auth else None
        if keys is not None:
            watching.append(asyncio.create_task(watch_keys(etcd, keys.on_keys), name="key-watch"))
            # The tenants' limits, shared with the other replicas through etcd.
            watching.append(asyncio.create_task(keys.gate.run(), name="tenant-limits"))
        metrics.tenant_limits_shared.set_function(lambda: float(keys is None or keys.gate.shared))

        async def on_load(report: WorkerLoadReported) -> None:
            liveness.reported(report.worker_id, report.occurred_at.timestamp())
            await admission.on_load(report)

        await bus.subscribe(Subjects.all_load, on_load)
        app = create_app(
            gateway,
            _tokenizer(settings.model_dir),
            settings.api(),
            limit,
            metrics,
            admission=admission,
            keys=keys,
            readiness=readiness,
            worker_features=features,
            adapters=AdapterEndpoints(
                adapters,
                settings.served_model_names,
                add=functools.partial(add_adapter, etcd),
                remove=functools.partial(remove_adapter, etcd),
            ),
        )
        # The API port has /metrics too; this port is the one every service has (probes).
        probes = MetricsServer(metrics.registry)
        await probes.start(settings.metrics_host, settings.metrics_port)
        probes.ready_when("bus", lambda: bus.nc.is_connected)
        server = _Server(http_config(app, settings))
        probes.ready_when("listening", lambda: server.started)
        # Serving once this replica answers as the others do: its context limit and admission
        # known, and, where keys are asked for, the keys (else every request would get 503).
        read = [
            workers_read.wait(),
            adapters.read.wait(),
            *([keys.wait_loaded()] if keys is not None else []),
        ]
        if await _until_all(stop, read):
            serving = asyncio.create_task(server.serve(sockets=[listener]))
            await stop.wait()
            server.should_exit = True
            await serving
            # Requests still in flight when the grace ran out were cancelled: each tells its
            # worker and its client so (a 503) before the bus and the connections go.
            if server.server_state.tasks:
                await asyncio.wait(server.server_state.tasks, timeout=_ENDING_S)
        listener.close()
        if keys is not None:
            await keys.gate.close()
        await probes.close()
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        await etcd.close()
        await bus.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
