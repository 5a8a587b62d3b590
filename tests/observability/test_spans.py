"""One request, one trace, through every hop: the ingress, the planner, the kv-indexer's overlap
answer (a core NATS request whose headers carry the trace) and both sides of a KV hand-off, as
the file exporter writes them from each process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from tests.conftest import ClusterFactory
from tests.helpers import eventually

Span = dict[str, Any]


def trace_of(spans_file: Path, request_id: str) -> list[Span] | None:
    """The spans of the request's trace, once the last of them (the decode side's) is written."""
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    roots = [
        s
        for s in spans
        if s["name"] == "ingress.request"
        and s["attributes"].get("laneway.request_id") == request_id
    ]
    if not roots:
        return None
    found = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
    names = {s["name"] for s in found}
    return found if {"worker.generate", "worker.kv_receive"} <= names else None


def one(spans: list[Span], name: str) -> Span:
    named = [s for s in spans if s["name"] == name]
    assert len(named) == 1, f"{name}: {len(named)} spans"
    return named[0]


async def test_every_hop_is_one_trace_with_the_right_parents(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    cluster = cluster_factory(
        workers=1,
        prefill_workers=1,
        env={"LANEWAY_TRACE_EXPORTER": f"file:{spans_file}", "LANEWAY_DISAGG": "always"},
    )
    client = openai.AsyncOpenAI(base_url=cluster.config.base_url, api_key="x", max_retries=0)
    reply = await client.completions.create(
        model="laneway-sim", prompt="a prompt long enough for blocks " * 8, max_tokens=4
    )
    spans = await eventually(lambda: trace_of(spans_file, reply.id.removeprefix("cmpl-")))

    assert len({s["trace_id"] for s in spans}) == 1
    ingress = one(spans, "ingress.request")
    route = one(spans, "planner.route")
    overlap = one(spans, "kv_indexer.overlap")
    prefill, send = one(spans, "worker.prefill"), one(spans, "worker.kv_send")
    generate = one(spans, "worker.generate")
    wait, receive = one(spans, "worker.kv_wait"), one(spans, "worker.kv_receive")
    parents = {s["name"]: s["parent_id"] for s in spans}
    assert parents == {
        "ingress.request": None,
        "planner.route": ingress["span_id"],
        "kv_indexer.overlap": route["span_id"],
        "worker.prefill": route["span_id"],
        "worker.kv_send": prefill["span_id"],
        "worker.generate": route["span_id"],
        "worker.kv_wait": generate["span_id"],
        "worker.kv_receive": generate["span_id"],
    }
    assert overlap["service"] == "laneway-kv-indexer"
    assert overlap["attributes"]["laneway.query_blocks"] > 0
    # The receiving side points back at what it received: the sender's span.
    assert receive["links"] == [send["span_id"]]
    assert wait["attributes"]["laneway.outcome"] == "prefilled"
    assert wait["end_ns"] <= receive["start_ns"]
    # Each side's spans come from its own worker process.
    assert prefill["instance"] == send["instance"] != generate["instance"]
    assert {wait["instance"], receive["instance"]} == {generate["instance"]}
