"""Log injection through the real ingress: a line feed in a URL path (``%0a``, no key needed) or
in a request's ``model`` used to end the access-log line and start a forged one, with its own
time and ``status=200``. Each request now leaves one line, the client's text escaped in it
(observability.log_text)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from infra.cluster import LocalCluster
from tests.live import ClusterFactory

pytestmark = pytest.mark.live  # a cluster of real processes

FORGED = "2026-12-06 00:00:00,000 INFO services.ingress.access_log: POST /v1/completions"
_ACCESS = " INFO services.ingress.access_log: "


def _access_lines(log: Path, marker: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if marker in line]


def test_a_request_leaves_one_escaped_access_line(cluster_factory: ClusterFactory) -> None:
    cluster: LocalCluster = cluster_factory(workers=1)
    log = cluster.service("ingress").log_file
    assert log is not None
    base = cluster.config.base_url
    # No key: refused by the key check, which logs the path it was sent.
    path = f"/x-path-marker%0a{FORGED} status=200 id=x%0d%1b[2J%e2%80%a8"
    refused = httpx.get(base + path, timeout=10)
    assert refused.status_code == 401
    model = f"model-marker\n{FORGED} status=200 id=y"
    unknown = httpx.post(
        base + "/completions",
        json={"model": model, "prompt": "Once", "max_tokens": 2},
        headers=cluster.api_headers,
        timeout=10,
    )
    assert unknown.status_code == 404  # no such model: logged with the model it was given
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _access_lines(log, "model-marker"):
        time.sleep(0.05)
    (by_path,) = _access_lines(log, "x-path-marker")
    (by_model,) = _access_lines(log, "model-marker")
    assert not [line for line in log.read_text().splitlines() if line.startswith(FORGED[:19])]
    assert _ACCESS in by_path and _ACCESS in by_model
    # Control characters, the line separator and the spaces that would start a field escaped.
    assert (
        "GET /v1/x-path-marker\\n2026-12-06\\x2000:00:00,000\\x20INFO" in by_path
        and "\\r\\x1b[2J\\u2028 status=401 " in by_path
    ), by_path
    assert " status=404 " in by_model and "model=model-marker\\n2026-12-06\\x20" in by_model
    assert by_model.count(" status=") == 1
