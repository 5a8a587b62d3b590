"""One request, one trace, through every hop: the ingress, the planner, the kv-indexer's overlap
answer (a core NATS request whose headers carry the trace) and both sides of a KV hand-off, as
the file exporter writes them from each process."""

from __future__ import annotations

import json
from pathlib import Path

import openai

from tests.helpers import eventually
from tests.live import ClusterFactory
from tests.observability.hops import DISAGG, PROMPT, check_hops, request_trace


async def test_every_hop_is_one_trace_with_the_right_parents(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    spans_file = tmp_path / "spans.jsonl"
    cluster = cluster_factory(
        workers=1, prefill_workers=1, env={"LANEWAY_TRACE_EXPORTER": f"file:{spans_file}", **DISAGG}
    )
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    reply = await client.completions.create(model="laneway-sim", prompt=PROMPT, max_tokens=4)
    request_id = reply.id.removeprefix("cmpl-")

    def written() -> list[dict[str, object]] | None:
        return request_trace(
            [json.loads(s) for s in spans_file.read_text().splitlines()], request_id
        )

    hops = check_hops(await eventually(written))
    overlap, send = hops["kv_indexer.overlaps"], hops["worker.kv_send"]
    wait, receive = hops["worker.kv_wait"], hops["worker.kv_receive"]
    assert overlap["service"] == "laneway-kv-indexer"
    assert hops["planner.route"]["attributes"]["laneway.overlap_source"] == "indexer"
    assert overlap["attributes"]["laneway.queries"] == 1  # one request: a batch of one
    assert overlap["attributes"]["laneway.query_blocks"] > 0
    # The receiving side points back at what it received: the sender's span.
    assert receive["links"] == [send["span_id"]]
    assert wait["attributes"]["laneway.outcome"] == "prefilled"
    assert wait["end_ns"] <= receive["start_ns"]
    # Each side's spans come from its own worker process.
    prefill, generate = hops["worker.prefill"], hops["worker.generate"]
    assert prefill["instance"] == send["instance"] != generate["instance"]
    assert {wait["instance"], receive["instance"]} == {generate["instance"]}
