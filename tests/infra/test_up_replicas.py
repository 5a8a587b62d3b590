"""`laneway up --planners 2`: both planner replicas start, register, and route a share of the
requests each (the durable's deliver group spreads them), so routing scales out."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from infra.ports import free_port
from tests.infra.laneway_up import api_headers, launch, wait_serving

pytestmark = pytest.mark.live  # starts `laneway up`, its servers and services


def _decisions(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("laneway_planner_decisions_total{")
    )


def test_two_planner_replicas_each_route_a_share(tmp_path: Path) -> None:
    port = free_port()
    proc = launch(port, tmp_path, "--workers", "2", "--planners", "2")
    try:
        pids = wait_serving(proc)
        assert {"planner-0", "planner-1"} <= pids.keys(), pids
        headers = api_headers(tmp_path)
        body = {"model": "laneway-sim", "prompt": "share and share alike", "max_tokens": 2}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=30.0) as http:
            for _ in range(40):
                reply = http.post("/completions", json=body, headers=headers)
                assert reply.status_code == 200, reply.text
        targets = json.loads((tmp_path / "prometheus-targets.json").read_text())
        ports = {t["labels"]["service"]: int(t["targets"][0].rpartition(":")[2]) for t in targets}
        routed = {name: _decisions(ports[name]) for name in ("planner-0", "planner-1")}
        # Each of 40 requests to either replica: all to one is a 2 in 10^12 chance.
        assert sum(routed.values()) == 40 and all(n > 0 for n in routed.values()), routed
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
