"""OTLP export end to end: a cluster with ``--trace-exporter otlp`` sends every hop's spans to a
real OTLP backend, Arize Phoenix (from PyPI; `make test` installs it in a virtualenv of its own,
as the standard OpenTelemetry Collector is on neither PyPI nor Debian), and its query API gives
the request's trace back whole."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from infra.embedded import die_with_parent, stop_process, wait_for_port
from infra.ports import free_port
from tests.helpers import eventually
from tests.live import ClusterFactory
from tests.observability.hops import DISAGG, PROMPT, check_hops, request_trace

# Where the Makefile installs Phoenix: beside the project's packages, not among them (it pins
# its own versions of what Laneway depends on).
PHOENIX = Path(sys.executable).parents[1] / "phoenix" / "bin" / "phoenix"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Phoenix server on free loopback ports; its base URL."""
    assert PHOENIX.exists(), f"no Phoenix at {PHOENIX}: `make test` installs it"
    work = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = work / "phoenix.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(PHOENIX), "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),
        )
    try:
        wait_for_port(port, proc, "phoenix", timeout=120, log=log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def stored_spans(base_url: str) -> list[dict[str, Any]]:
    """Every span Phoenix holds, in the shape the file exporter writes."""
    reply = httpx.get(f"{base_url}/v1/projects/default/spans", params={"limit": 1000})
    if reply.status_code == 404:  # no span has arrived yet, so no project either
        return []
    reply.raise_for_status()
    return [
        {
            "name": s["name"],
            "trace_id": s["context"]["trace_id"],
            "span_id": s["context"]["span_id"],
            "parent_id": s["parent_id"],
            "attributes": s["attributes"],
        }
        for s in reply.json()["data"]
    ]


async def test_a_request_s_spans_reach_an_otlp_backend(
    cluster_factory: ClusterFactory, phoenix: str
) -> None:
    cluster = cluster_factory(
        workers=1,
        prefill_workers=1,
        env={
            "LANEWAY_TRACE_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix,
            # The batch processor's standard setting: export within 0.2 s, not 5 s.
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            **DISAGG,
        },
    )
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    reply = await client.completions.create(model="laneway-sim", prompt=PROMPT, max_tokens=4)
    request_id = reply.id.removeprefix("cmpl-")

    spans = await eventually(lambda: request_trace(stored_spans(phoenix), request_id), timeout=20)
    hops = check_hops(spans)
    assert hops["planner.route"]["attributes"]["laneway.request_id"] == request_id
    assert hops["kv_indexer.overlaps"]["attributes"]["laneway.query_blocks"] > 0
