"""The embedded NATS and etcd of a local cluster: one of each, or three of each (``--ha``), with
the cluster's users and, from ``--bus-tls-dir``, TLS for their clients."""

from __future__ import annotations

import os
from pathlib import Path

from bus.tls import BusTlsDir
from infra.embedded import (
    NATS_MAX_PAYLOAD,
    EmbeddedServer,
    start_etcd,
    start_etcd_cluster,
    start_nats,
    start_nats_cluster,
)
from infra.startup import StartupError


def bus_tls(folder: Path | None) -> BusTlsDir | None:
    """The bus's TLS files, checked; their settings put in this process's environment, where
    its own clients (and the tools it runs) take them from, as the services do."""
    if folder is None:
        return None
    try:
        tls = BusTlsDir(folder)
    except ValueError as exc:
        raise StartupError(f"--bus-tls-dir: {exc}") from None
    os.environ.update(tls.env())
    return tls


def _served(tls: BusTlsDir | None) -> tuple[tuple[Path, Path] | None, Path | None]:
    """The servers' certificate and key, and the CA their clients' certificates need."""
    if tls is None:
        return None, None
    return tls.server, tls.ca if tls.client_certs else None


def embedded_nats(
    data_dir: Path,
    logs: Path,
    ha: bool,
    port: int | None,
    users: str,
    tls: BusTlsDir | None,
) -> list[EmbeddedServer]:
    served, client_ca = _served(tls)
    if ha:
        return start_nats_cluster(data_dir, logs, 3, users, served, client_ca)
    log = logs / "nats.log"
    return [start_nats(data_dir, port, log, NATS_MAX_PAYLOAD, users, served, client_ca)]


def embedded_etcd(
    data_dir: Path, logs: Path, ha: bool, port: int | None, tls: BusTlsDir | None
) -> list[EmbeddedServer]:
    served, client_ca = _served(tls)
    if ha:
        return start_etcd_cluster(data_dir, logs, 3, served, client_ca)
    return [start_etcd(data_dir, port, logs / "etcd.log", served, client_ca)]
