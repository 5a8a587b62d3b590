"""A real Prometheus (Debian's ``prometheus``, which ``make test`` installs) scrapes a local
cluster through the targets file ``laneway up`` writes: every service's target is up, and the
figures an operator watches come back from PromQL once requests have gone through."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.cluster import LocalCluster
from infra.ports import free_port
from observability.dashboard import PANELS, RATE
from tests.live import ClusterFactory

# Each a query that must come back with a value above zero after the requests below.
QUERIES = (
    'sum(laneway_worker_tokens_total{kind="generated"})',
    "sum(laneway_planner_decisions_total)",
    'sum(laneway_ingress_requests_total{status="200"})',
    "sum(laneway_kv_indexer_events_total)",
    "sum(laneway_planner_workers)",
    "histogram_quantile(0.95, sum by (le) (laneway_ingress_e2e_latency_seconds_bucket))",
)


def _config(targets: Path) -> str:
    return f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: laneway
    file_sd_configs:
      - files: ["{targets}"]
        refresh_interval: 1s
"""


@pytest.fixture
def prometheus(tmp_path: Path, cluster: LocalCluster) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, (
        "prometheus is not installed: `make test` installs it (apt-get install prometheus)"
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(_config(cluster.prometheus_targets))
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={address}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        yield f"http://{address}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=2)


def _api(base: str, path: str, **params: str) -> Any:
    try:
        reply = httpx.get(base + path, params=params, timeout=2.0)
    except httpx.HTTPError:
        return None  # still starting
    return reply.json()["data"] if reply.status_code == 200 else None


def test_prometheus_takes_every_dashboard_query(cluster: LocalCluster, prometheus: str) -> None:
    # Grafana puts its own window in for $__rate_interval; any valid one will do here.
    exprs = [expr.replace(RATE, "[1m]") for panel in PANELS for expr, _ in panel.queries]
    _until(
        "Prometheus up", time.monotonic() + 15, lambda: _api(prometheus, "/api/v1/query", query="1")
    )
    for expr in exprs:
        reply = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=2.0)
        assert reply.json()["status"] == "success", (expr, reply.text)


def _until(what: str, deadline: float, check: Any) -> Any:
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what} not within the time given; last answer: {last!r}")


def test_prometheus_scrapes_every_service(cluster: LocalCluster, prometheus: str) -> None:
    deadline = time.monotonic() + 35
    # Turns of one conversation: the later ones share the earlier prompts' blocks.
    prompt = "the same long system prompt for every request, " * 8
    for turn in range(6):
        reply = httpx.post(
            cluster.config.base_url + "/completions",
            json={"model": "laneway-sim", "prompt": prompt + str(turn), "max_tokens": 8},
            headers=cluster.api_headers,
            timeout=10,
        )
        assert reply.status_code == 200, reply.text

    expected = {f"127.0.0.1:{s.metrics_port}" for s in cluster.services}

    def all_up() -> dict[str, str] | None:
        data = _api(prometheus, "/api/v1/targets")
        if data is None:
            return None
        health = {t["labels"]["instance"]: t["health"] for t in data["activeTargets"]}
        return health if set(health) == expected and set(health.values()) == {"up"} else None

    health = _until("every service's target up", deadline, all_up)
    assert len(health) == len(cluster.services)

    for query in QUERIES:

        def answered(query: str = query) -> float | None:
            data = _api(prometheus, "/api/v1/query", query=query)
            if not data or not data["result"]:
                return None
            value = float(data["result"][0]["value"][1])
            return value if value > 0 else None

        assert _until(query, deadline, answered) > 0
    tokens = _api(prometheus, "/api/v1/query", query=QUERIES[0])["result"][0]["value"][1]
    assert float(tokens) == 6 * 8  # every generated token counted once, on its worker
