"""``laneway status``: the cluster as an operator needs it, read from NATS and etcd.

Services, their replicas and where each was seen; the workers with role, lease, load and KV
usage; the planner leader; stream sizes and consumer lag; the health of every NATS server and
etcd member given. Without ``--nats-url``/``--etcd-endpoints``, or the services' own
``LANEWAY_NATS_URL``/``LANEWAY_ETCD_ENDPOINTS`` (in a pod), the URLs are those of the
`laneway up` running on ``--state-dir``, read from the environment of one of its services.
Nothing here writes to the cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.credentials import inbox_prefix, nats_options, split_credentials
from bus.registry import LEADER_KEY, PLANNERS_PREFIX, WORKERS_PREFIX, connect_etcd
from bus.topology import CONTROL, KV, LOAD, Subjects, worker_routes
from infra import up_processes
from infra.status_tables import render
from schemas.codec import decode_event
from schemas.envelope import Envelope
from schemas.events import CapacityReviewed, WorkerLoadReported
from schemas.messages import WorkerRegistration

# A status that waits on a dead server is no status: each server gets this long to answer.
_CONNECT_TIMEOUT_S = 2


class NoCluster(Exception):
    """No cluster to look at: the one line that says why."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status", help="services, workers, leader, streams and server health of a cluster"
    )
    # In a pod, the services' own settings: `kubectl exec deploy/planner -- laneway status`.
    status.add_argument(
        "--nats-url", help="NATS server URL(s), comma-separated (default: $LANEWAY_NATS_URL)"
    )
    status.add_argument(
        "--etcd-endpoints",
        help="etcd endpoints (host:port), comma-separated (default: $LANEWAY_ETCD_ENDPOINTS)",
    )
    status.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".state"),
        help="the state dir of the `laneway up` to look at when no URLs are given or set",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0: every server answers, JetStream is on and every local process runs and is ready;
    1: something is not; 2: no cluster."""
    try:
        nats_url = args.nats_url or os.environ.get("LANEWAY_NATS_URL")
        etcd_endpoints = args.etcd_endpoints or os.environ.get("LANEWAY_ETCD_ENDPOINTS")
        found = asyncio.run(gather(nats_url, etcd_endpoints, args.state_dir))
    except NoCluster as err:
        print(f"laneway status: {err}", file=sys.stderr)
        return 2
    print(json.dumps(found, indent=2) if args.json else render(found))
    return 0 if found["healthy"] else 1


def _split(urls: str) -> list[str]:
    return [url.strip() for url in urls.split(",") if url.strip()]


def _resolve(
    nats_url: str | None, etcd_endpoints: str | None, state_dir: Path
) -> tuple[str, str, str, list[dict[str, Any]]]:
    """The NATS URLs and etcd endpoints to ask, where they came from, and the local processes."""
    if nats_url and etcd_endpoints:
        return nats_url, etcd_endpoints, "given", []
    local = up_processes.processes(state_dir)
    found = up_processes.urls(local)
    if found is None:
        if nats_url or etcd_endpoints:  # the other half was to come from that state dir
            missing = "--etcd-endpoints" if nats_url else "--nats-url"
            raise NoCluster(f"give {missing} as well (no running `laneway up` to read it from)")
        raise NoCluster(
            f"no running `laneway up` on {state_dir.resolve()}: start one, pass its "
            "--state-dir, or give --nats-url and --etcd-endpoints"
        )
    return nats_url or found[0], etcd_endpoints or found[1], str(state_dir.resolve()), local


async def gather(
    nats_url: str | None, etcd_endpoints: str | None, state_dir: Path
) -> dict[str, Any]:
    nats_urls, etcd_urls, source, local = _resolve(nats_url, etcd_endpoints, state_dir)
    now = datetime.now(UTC)
    servers, nc = await _each(_split(nats_urls), _nats_server)
    members, etcd = await _each(_split(etcd_urls), _etcd_member)
    found: dict[str, Any] = {
        "source": source,
        "nats": {"servers": servers, "jetstream": None},
        "etcd": {"members": members},
        "planner": {"leader": None, "replicas": []},
        "workers": [],
        "streams": [],
        "consumers": [],
        "processes": await up_processes.probe(local),
    }
    try:
        if etcd is not None:
            try:
                found["planner"] = await _planners(etcd)
                found["workers"] = await _workers(etcd)
            except aetcd.ClientError as exc:
                # Answering its status, refusing its keys (no user, or a wrong one): the
                # member is up, this look at it is not.
                asked = next(m for m in members if m["ok"])
                asked.update(ok=False, error=_error(exc))
        if nc is not None:
            js = nc.jetstream()
            found["nats"]["jetstream"] = await _jetstream(js)
            if found["nats"]["jetstream"]["enabled"]:
                found["streams"], found["consumers"] = await _streams(js)
                await _add_loads(js, found["workers"], now)
                found["planner"]["capacity"] = await _capacity(js, now)
    finally:
        if nc is not None:
            await nc.close()
        if etcd is not None:
            await etcd.close()
    _mark_orphans(found)
    found["services"] = _services(found)
    found["healthy"] = (
        all(s["ok"] for s in servers)
        and all(m["ok"] for m in members)
        and bool(found["nats"]["jetstream"] and found["nats"]["jetstream"]["enabled"])
        and all(p["alive"] and p.get("ready", True) for p in found["processes"])
    )
    return found


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__


C = TypeVar("C", NatsClient, aetcd.Client)


async def _each(
    addresses: list[str], ask: Callable[[str], Awaitable[tuple[dict[str, Any], C | None]]]
) -> tuple[list[dict[str, Any]], C | None]:
    """Every address asked at once, so that servers down cost one timeout, not one each; the
    first client that answered stays open for the rest of the questions."""
    answers = await asyncio.gather(*(ask(address) for address in addresses))
    kept = next((client for _, client in answers if client is not None), None)
    for _, client in answers:
        if client is not None and client is not kept:
            await client.close()
    return [entry for entry, _ in answers], kept


async def _nats_server(url: str) -> tuple[dict[str, Any], NatsClient | None]:
    async def quiet(_: Exception) -> None:  # the failure is in the table, not a log line
        return None

    shown = split_credentials(url)[1]  # never a password on the screen

    try:
        # nats-py keeps trying a lone server that refuses, reconnects off or not.
        nc = await asyncio.wait_for(
            nats.connect(
                name="laneway-status",
                connect_timeout=_CONNECT_TIMEOUT_S,
                allow_reconnect=False,
                error_cb=quiet,
                **nats_options(url),
            ),
            _CONNECT_TIMEOUT_S,
        )
    except TimeoutError:
        return {"url": shown, "ok": False, "error": f"no answer in {_CONNECT_TIMEOUT_S}s"}, None
    except Exception as exc:
        return {"url": shown, "ok": False, "error": _error(exc)}, None
    info = nc._server_info  # the INFO the server sent: version, name, cluster
    entry = {
        "url": shown,
        "ok": True,
        "version": info.get("version"),
        "name": info.get("server_name"),
        "cluster": info.get("cluster"),
    }
    return entry, nc


async def _etcd_member(endpoint: str) -> tuple[dict[str, Any], aetcd.Client | None]:
    client = connect_etcd(endpoint)
    shown = split_credentials(endpoint)[1]
    try:
        status = await asyncio.wait_for(client.status(), _CONNECT_TIMEOUT_S * 2)
    except Exception as exc:
        await client.close()
        return {"endpoint": shown, "ok": False, "error": _error(exc)}, None
    entry = {
        "endpoint": shown,
        "ok": True,
        "version": status.version,
        "leader": status.leader.name if status.leader is not None else None,
        "raft_term": status.raft_term,
        "db_bytes": status.db_size,
    }
    return entry, client


async def _planners(etcd: aetcd.Client) -> dict[str, Any]:
    leader = await etcd.get(LEADER_KEY)
    replicas = [
        kv.key[len(PLANNERS_PREFIX) :].decode()
        for kv in await etcd.get_prefix(PLANNERS_PREFIX, keys_only=True)
    ]
    return {"leader": leader.value.decode() if leader else None, "replicas": sorted(replicas)}


async def _workers(etcd: aetcd.Client) -> list[dict[str, Any]]:
    workers = []
    for kv in await etcd.get_prefix(WORKERS_PREFIX):
        reg = WorkerRegistration.model_validate_json(kv.value)
        lease = await etcd.get_lease_info(kv.lease, keys=False) if kv.lease else None
        workers.append(
            {
                "worker_id": reg.worker_id,
                "model": reg.model,
                "role": reg.role,
                "draining": reg.draining,
                "engine": reg.engine,
                "pid": reg.pid,
                # The keep-alive refreshes at a third of the TTL: left near granted is healthy.
                "lease_ttl_left_s": lease.TTL if lease else None,
                "lease_granted_s": lease.grantedTTL if lease else None,
                "kv_blocks_total": reg.kv_blocks_total,
            }
        )
    return sorted(workers, key=lambda w: (w["role"], w["worker_id"]))


async def _jetstream(js: JetStreamContext) -> dict[str, Any]:
    try:
        account = await js.account_info()
    except Exception as exc:
        return {"enabled": False, "error": _error(exc)}
    return {
        "enabled": True,
        "memory_bytes": account.memory,
        "storage_bytes": account.storage,
        "streams": account.streams,
        "consumers": account.consumers,
    }


async def _streams(js: JetStreamContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    streams, consumers = [], []
    for info in sorted(await js.streams_info(), key=lambda i: i.config.name or ""):
        name = info.config.name or ""
        cluster = info.cluster
        streams.append(
            {
                "name": name,
                "messages": info.state.messages,
                "bytes": info.state.bytes,
                "replicas": info.config.num_replicas,
                # The leader and each follower that has caught up with it.
                "replicas_current": 1 + sum(bool(r.current) for r in cluster.replicas or [])
                if cluster and cluster.leader
                else None,
                "leader": cluster.leader if cluster else None,
                "consumers": info.state.consumer_count,
            }
        )
        for c in await js.consumers_info(name):
            consumers.append(
                {
                    "stream": name,
                    "name": c.name,
                    "durable": bool(c.config.durable_name),
                    "filter": c.config.filter_subject,
                    "deliver": c.config.deliver_subject,
                    # Stored but not yet delivered, then delivered but not yet acked: the lag.
                    "pending": c.num_pending or 0,
                    "ack_pending": c.num_ack_pending or 0,
                    "redelivered": c.num_redelivered or 0,
                }
            )
    consumers.sort(key=lambda c: (c["stream"], not c["durable"], c["name"]))
    return streams, consumers


async def _add_loads(js: JetStreamContext, workers: list[dict[str, Any]], now: datetime) -> None:
    """Each worker's latest load report, which the load stream keeps per worker."""
    for worker in workers:
        try:
            msg = await js.get_last_msg(LOAD.name, Subjects.load(worker["worker_id"]).subject)
        except NotFoundError:
            continue
        report = decode_event(msg.data or b"")
        if not isinstance(report, WorkerLoadReported):
            continue
        worker.update(
            running=report.running,
            waiting=report.waiting,
            kv_blocks_used=report.kv_blocks_used,
            kv_usage=report.kv_blocks_used / max(1, report.kv_blocks_total),
            report_age_s=(now - report.occurred_at).total_seconds(),
        )


async def _capacity(js: JetStreamContext, now: datetime) -> dict[str, Any] | None:
    """The capacity loop's last look (``--autoscale`` only): what it saw and did, and the
    targets no move between the pools can meet."""
    try:
        msg = await js.get_last_msg(CONTROL.name, Subjects.capacity_reviewed.subject)
    except NotFoundError:
        return None
    review = decode_event(msg.data or b"")
    if not isinstance(review, CapacityReviewed):
        return None
    return {
        **review.model_dump(mode="json", exclude=set(Envelope.model_fields) | {"type"}),
        "age_s": (now - review.occurred_at).total_seconds(),
    }


def _mark_orphans(found: dict[str, Any]) -> None:
    """A worker's route consumer outlives the worker by its inactivity threshold: one whose
    worker holds no lease is marked, its pending messages lost with the worker."""
    live = {worker_routes(w["worker_id"]).durable for w in found["workers"]}
    prefix = worker_routes("").durable
    for consumer in found["consumers"]:
        consumer["orphaned"] = consumer["name"].startswith(prefix) and consumer["name"] not in live


def _kind(process: str) -> str:
    """`decode-worker-1` → `decode-worker`: a service's name without its replica number."""
    base, _, number = process.rpartition("-")
    return base if number.isdigit() and base else process


def _services(found: dict[str, Any]) -> list[dict[str, Any]]:
    """Replicas of each service, from the trace it leaves; and, for a local cluster, its
    processes running and ready beside that."""
    roles = [w["role"] for w in found["workers"]]
    # The kv-indexer keeps no durable: each replica replays the KV stream on an ordered one.
    # So may each planner (its own fold); with bus auth its deliveries come to its own inbox,
    # and it is told apart by that (without, it counts here too).
    planners = inbox_prefix("planner") + "."
    indexers = [
        c
        for c in found["consumers"]
        if c["stream"] == KV.name
        and c["filter"] == Subjects.all_kv.subject
        and not (c["deliver"] or "").startswith(planners)
    ]
    traced: dict[str, tuple[int | None, str]] = {
        "planner": (len(found["planner"]["replicas"]), "etcd presence keys"),
        "kv-indexer": (len(indexers), "ordered consumers on " + KV.name),
        "decode-worker": (roles.count("decode") + roles.count("both"), "etcd worker keys"),
        "prefill-worker": (roles.count("prefill"), "etcd worker keys"),
        "ingress": (None, "leaves no etcd key or JetStream consumer"),
    }
    services = []
    for name, (replicas, where) in traced.items():
        mine = [p for p in found["processes"] if _kind(p["name"]) == name]
        services.append(
            {
                "service": name,
                "replicas": replicas,
                "seen_in": where,
                "processes": sum(p["alive"] for p in mine) if mine else None,
                "ready": sum(bool(p.get("ready")) for p in mine) if mine else None,
            }
        )
    return services
