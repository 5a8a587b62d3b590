"""The processes of the `laneway up` on a state dir, for ``laneway status``: which still run,
the NATS and etcd they were given, and each service's answer on its ``/readyz``.

The settings are read from each process's environment (``/proc/PID/environ``), which is where
`laneway up` hands them over; nothing is written to the state dir for this."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from bus.credentials import ETCD_CREDS_ENV, NATS_CREDS_ENV
from infra.cluster_auth import admin_within
from infra.statedir import PIDS_FILE, start_time

_NATS, _ETCD = "LANEWAY_NATS_URL", "LANEWAY_ETCD_ENDPOINTS"
_METRICS_HOST, _METRICS_PORT = "LANEWAY_METRICS_HOST", "LANEWAY_METRICS_PORT"
_SETTINGS = (_NATS, _ETCD, _METRICS_HOST, _METRICS_PORT, NATS_CREDS_ENV, ETCD_CREDS_ENV)
_PROBE_TIMEOUT_S = 1.0


def _settings_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition("=") for item in raw.decode(errors="replace").split("\0"))
    return {key: value for key, _, value in pairs if key in _SETTINGS}


def processes(state_dir: Path) -> list[dict[str, Any]]:
    """What the `laneway up` on ``state_dir`` started, with the settings it gave each; empty
    when none runs there (the list goes when it stops; a killed one's PIDs name dead processes
    or, reused since, others: the start time tells)."""
    try:
        known = json.loads((state_dir / PIDS_FILE).read_text())
    except (OSError, ValueError):
        return []
    found = []
    for name, (pid, started) in known.items():
        alive = bool(started) and start_time(pid) == started
        found.append(
            {
                "name": name,
                "pid": pid,
                "alive": alive,
                "settings": _settings_of(pid) if alive else {},
            }
        )
    return found


def urls(local: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The NATS URL(s) and etcd endpoint(s) the running services were given; with the admin's
    credentials in them where the services were given credentials (``laneway up`` with auth)."""
    for process in local:
        settings = process["settings"]
        if _NATS in settings and _ETCD in settings:
            return (
                admin_within(settings.get(NATS_CREDS_ENV), settings[_NATS]),
                admin_within(settings.get(ETCD_CREDS_ENV), settings[_ETCD]),
            )
    return None


async def probe(local: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each process by name, pid and whether it runs; a service with a metrics port also with
    its ``/readyz`` answer (``ready``, and what it waits for when not)."""

    async def ask(client: httpx.AsyncClient, process: dict[str, Any]) -> dict[str, Any]:
        entry = {k: process[k] for k in ("name", "pid", "alive")}
        settings = process["settings"]
        port = settings.get(_METRICS_PORT, "0")
        if not process["alive"] or port == "0":
            return entry
        host = settings.get(_METRICS_HOST, "127.0.0.1")
        try:
            reply = await client.get(f"http://{host}:{port}/readyz")
        except httpx.HTTPError as exc:
            return {**entry, "ready": False, "readiness": f"/readyz unanswered: {exc!r}"}
        return {**entry, "ready": reply.status_code == 200, "readiness": reply.text.strip()}

    async with httpx.AsyncClient(timeout=_PROBE_TIMEOUT_S) as client:
        return list(await asyncio.gather(*(ask(client, p) for p in local)))
