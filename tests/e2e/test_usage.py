"""Usage per tenant on a live cluster with keys: `laneway usage --json` (run as an operator runs
it) sums what every client was told in `usage`, per tenant, exactly; a stream the client cuts is
charged its prompt and the tokens generated before the stop; the ingress counts each tenant's
tokens for Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from infra.cluster import LocalCluster
from tests.live import ClusterFactory
from tests.security.keys_cli import create

REPO = Path(__file__).resolve().parents[2]
MODEL = "laneway-sim"


def usage(cluster: LocalCluster) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "infra.cli", "usage", "--json", "--nats-url", cluster.nats_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tenants: dict[str, Any] = json.loads(done.stdout)["tenants"]
    return tenants


def ask(http: httpx.Client, key: str, i: int, stream: bool) -> dict[str, int]:
    """One request; the usage its client was told."""
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"usage question {i} " * (1 + i % 3)}],
        "max_tokens": 3 + i % 4,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        reply = http.post("/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        told: dict[str, int] = reply.json()["usage"]
        return told
    with http.stream("POST", "/chat/completions", json=body, headers=headers) as reply:
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
    told = json.loads(events[-2])["usage"]  # the last chunk before [DONE]
    return told


def test_usage_sums_what_each_tenant_was_told(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2)
    keys = {tenant: create(cluster, "--tenant", tenant) for tenant in ("acme", "globex")}
    told: dict[str, Counter[str]] = {tenant: Counter() for tenant in keys}
    with httpx.Client(base_url=cluster.config.base_url, timeout=30) as http:
        for i in range(12):
            tenant = "acme" if i % 3 else "globex"
            reply = ask(http, keys[tenant], i, stream=bool(i % 2))
            told[tenant].update(
                requests=1,
                prompt_tokens=reply["prompt_tokens"],
                completion_tokens=reply["completion_tokens"],
            )
        deadline = time.monotonic() + 10
        while True:
            got = usage(cluster)
            fields = ("requests", "prompt_tokens", "completion_tokens")
            summed = {t: {f: got.get(t, {}).get(f, 0) for f in fields} for t in keys}
            if summed == {t: dict(c) for t, c in told.items()} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert summed == {t: dict(c) for t, c in told.items()}
        assert got["acme"]["models"][MODEL]["requests"] == told["acme"]["requests"]

        # Prometheus, on the API port: each tenant's generated tokens.
        root = cluster.config.base_url.removesuffix("/v1")
        metrics = http.get(root + "/metrics").text.splitlines()
        line = f'laneway_ingress_completion_tokens_total{{model="{MODEL}",tenant="acme"}}'
        counted = next(float(m.split()[-1]) for m in metrics if m.startswith(line))
        assert counted == told["acme"]["completion_tokens"]

        # A long answer the client cuts after its first tokens: charged what was computed.
        body = {"model": MODEL, "prompt": "cut me short " * 8, "max_tokens": 4000, "stream": True}
        headers = {"Authorization": f"Bearer {keys['globex']}"}
        with http.stream("POST", "/completions", json=body, headers=headers) as cut:
            next(line for line in cut.iter_lines() if line.startswith("data: "))
        before = got["globex"]
        deadline = time.monotonic() + 10
        while (after := usage(cluster)["globex"])["requests"] == before["requests"]:
            assert time.monotonic() < deadline, "the cut stream was never charged"
            time.sleep(0.2)
        assert after["prompt_tokens"] > before["prompt_tokens"]
        assert 0 < after["completion_tokens"] - before["completion_tokens"] < 4000
