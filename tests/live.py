"""Helpers for the live tests, beside the server fixtures in conftest: the cluster factory's type,
servers of a test's own with auth on, the workers as etcd has them, a service's metrics, and an
observer of the cluster's events."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bus.api_keys import key_hash, list_keys
from bus.client import Bus
from bus.registry import WORKERS_PREFIX, connect_etcd
from bus.topology import Subjects
from infra.cluster import LocalCluster
from infra.cluster_auth import ClusterAuth, secure
from infra.cluster_plan import Service
from infra.embedded import NATS_MAX_PAYLOAD, EmbeddedServer, start_etcd, start_nats
from schemas.block_hash import chain_block_hashes, salt_root
from schemas.deltas import runs_delta
from schemas.events import Event, TokenBatch
from schemas.messages import WorkerRegistration

ClusterFactory = Callable[..., LocalCluster]

# Fast, deterministic workers for the end-to-end tests: 1 ms per decode step.
FAST_WORKERS = {
    "LANEWAY_PERF_MODEL": "fixed",
    "LANEWAY_LEASE_TTL_S": "2",
    "LANEWAY_LOAD_REPORT_INTERVAL_S": "0.2",
    "LANEWAY_DRAIN_TIMEOUT_S": "1",
}


def admin_nats(
    auth: ClusterAuth, data_dir: Path, max_payload: int = NATS_MAX_PAYLOAD
) -> EmbeddedServer:
    """A nats-server of a test's own that takes ``auth``'s users alone; its ``url`` carries the
    admin's credentials."""
    server = start_nats(data_dir, max_payload=max_payload, authorization=auth.nats_authorization())
    server.url = auth.admin("nats").within(server.url)
    return server


def admin_etcd(auth: ClusterAuth, data_dir: Path, log_file: Path | None = None) -> EmbeddedServer:
    """An etcd of a test's own with auth on, ``auth``'s users and roles and its root; its ``url``
    carries the admin's credentials."""
    server = start_etcd(data_dir, log_file=log_file)
    try:
        server.url = secure(auth, "", server.url, 1, nats=False, etcd=True)[1]
    except BaseException:
        server.stop()
        raise
    return server


async def registrations(etcd_endpoints: str) -> dict[str, WorkerRegistration]:
    etcd = connect_etcd(etcd_endpoints)
    try:
        return {
            reg.worker_id: reg
            for reg in (
                WorkerRegistration.model_validate_json(kv.value)
                for kv in await etcd.get_prefix(WORKERS_PREFIX)
            )
        }
    finally:
        await etcd.close()


async def metric(service: Service, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of ``name``'s samples that carry ``labels``, as ``service`` exposes them now."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{service.metrics_port}/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and (labels or {}).items() <= sample.labels.items()
    )


async def api_block_hashes(
    cluster: LocalCluster, token_ids: Sequence[int], block_size: int
) -> tuple[int, ...]:
    """The block hashes the ingress gives a prompt the cluster's clients send (with
    ``cluster.api_key``): in the chain of the key's cache group (``schemas.cache_salt``), read
    from its record in etcd; unsalted where the API takes no keys."""
    salt = None
    if cluster.api_key is not None:
        etcd = connect_etcd(cluster.etcd_endpoints)
        try:
            sha256 = key_hash(cluster.api_key)
            (record,) = [r for r in await list_keys(etcd) if r.sha256 == sha256]
        finally:
            await etcd.close()
        salt = record.cache_salt()
    return chain_block_hashes(token_ids, block_size, salt_root(salt))


class Observed:
    """The routes, hand-offs, terminal events and token deltas a cluster published, by event
    type."""

    def __init__(self) -> None:
        self.events: dict[str, list[Event]] = defaultdict(list)

    async def on_event(self, event: Event) -> None:
        if isinstance(event, TokenBatch):  # a step's tokens: each request's, as its own event
            self.events["TokensGenerated"] += (runs_delta(event, (run,)) for run in event.runs)
            return
        self.events[type(event).__name__].append(event)

    def of(self, kind: type[Event], request_id: str) -> list[Event]:
        return [e for e in self.events[kind.__name__] if e.request_id == request_id]


async def observe(nats_url: str) -> tuple[Bus, Observed]:
    bus = await Bus.connect(nats_url, "test-observer")
    seen = Observed()
    await bus.subscribe(Subjects.all_routes, seen.on_event)
    await bus.subscribe(Subjects.all_prefilled, seen.on_event)
    await bus.subscribe(Subjects.all_request_terminals, seen.on_event)
    await bus.subscribe(Subjects.all_tokens, seen.on_event)
    return bus, seen
