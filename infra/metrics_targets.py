"""Metrics ports for a local cluster's services: each gets a free loopback port for its
``/metrics``, ``/healthz`` and ``/readyz`` (``LANEWAY_METRICS_PORT``), and the lot is written as
a Prometheus ``file_sd_configs`` file, so that a Prometheus (or a test) finds every target."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import orjson

from infra.ports import free_port


class _Service(Protocol):
    name: str
    env: dict[str, str]
    metrics_port: int


def assign_metrics_ports(services: Sequence[_Service], targets_file: Path) -> None:
    for service in services:
        service.metrics_port = free_port()
        service.env["LANEWAY_METRICS_PORT"] = str(service.metrics_port)
    targets = [
        {"targets": [f"127.0.0.1:{s.metrics_port}"], "labels": {"service": s.name}}
        for s in services
    ]
    targets_file.write_bytes(orjson.dumps(targets, option=orjson.OPT_INDENT_2))
