"""vLLM's structured outputs through the whole live system: a ``response_format`` reaches vLLM's
grammar-constrained sampling on a worker running vLLM's engine (its CPU build, xgrammar) over
`laneway make-tiny-model`'s checkpoint.

- A ``json_schema`` answer parses and is valid against its schema, on both endpoints, streamed
  or not. The schemas are enums: any model, even the tiny one's random weights, completes them
  in a few tokens (an object schema lets such a model emit whitespace until max_tokens).
- ``json_object`` constrains the answer to begin as an object.
- A schema vLLM refuses is a 400 from the worker, before any token.
- A continuation of a structured answer (a migrated request) is refused by the engine with its
  reason, not sampled on from a fresh grammar.

The module's tests share one cluster of one vLLM worker, eager (no torch.compile): it loads in
about 12 s."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import (
    RequestAccepted,
    RequestFailed,
    RequestSpec,
    SamplingParams,
    StructuredOutput,
)
from tests.e2e.vllm_cluster import api, served_model, vllm_env
from tests.helpers import eventually
from tests.ingress.helpers import sse_data
from tests.live import ClusterFactory, observe, registrations

pytestmark = pytest.mark.xdist_group("vllm-structured")

COLOUR = {"enum": ["red", "green", "blue"]}
# Several JSON types, and an object whose whitespace the enum fixes.
MIXED = {"enum": [7, None, True, 'so "quoted"', {"colour": "red", "n": [1, 2]}]}
PROMPTS = [[5 + 17 * i + j for j in range(20 + 9 * i)] for i in range(4)]
MAX_TOKENS = 40


def json_schema(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory, vllm_model: Path) -> LocalCluster:
    return cluster_factory(workers=1, env=vllm_env(vllm_model), start_timeout=240)


@pytest.fixture
async def http(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with api(cluster) as client:
        yield client


async def test_the_worker_registers_structured_outputs(cluster: LocalCluster) -> None:
    (worker,) = (await registrations(cluster.etcd_endpoints)).values()
    assert worker.engine == "vllm" and worker.structured_outputs


@pytest.mark.parametrize("schema", [COLOUR, MIXED], ids=["strings", "mixed"])
async def test_json_schema_answers_parse_and_validate(
    cluster: LocalCluster, http: httpx.AsyncClient, schema: dict[str, Any]
) -> None:
    model, response_format = served_model(cluster), json_schema(schema)
    answers: list[tuple[str, str | None]] = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS}
        reply = await http.post("/completions", json={**body, "response_format": response_format})
        choice = reply.raise_for_status().json()["choices"][0]
        answers.append((choice["text"], choice["finish_reason"]))
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": MAX_TOKENS,
        "response_format": response_format,
    }
    reply = await http.post("/chat/completions", json=chat)
    choice = reply.raise_for_status().json()["choices"][0]
    answers.append((choice["message"]["content"], choice["finish_reason"]))
    streamed = await http.post("/chat/completions", json={**chat, "stream": True})
    chunks = [e for e in sse_data(streamed.raise_for_status().text) if isinstance(e, dict)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    answers.append((text, chunks[-1]["choices"][0]["finish_reason"]))
    for text, finish_reason in answers:
        # The grammar ends the answer (end of sequence) once the value is whole.
        assert finish_reason == "stop", (text, finish_reason)
        jsonschema.validate(json.loads(text), schema)
    # The same request streamed and not: the same answer.
    assert answers[-1] == answers[-2]
    # Free text from the same model is not JSON of the schema: the grammar made the difference.
    free = await http.post("/completions", json={**body, "max_tokens": 8})
    text = free.raise_for_status().json()["choices"][0]["text"]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text), schema)


async def test_json_object_begins_an_object(cluster: LocalCluster, http: httpx.AsyncClient) -> None:
    body = {
        "model": served_model(cluster),
        "prompt": PROMPTS[0],
        "max_tokens": 8,
        "response_format": {"type": "json_object"},
    }
    reply = await http.post("/completions", json=body)
    # Within 8 tokens the tiny model may not close it; that it opened one is the grammar's.
    assert reply.raise_for_status().json()["choices"][0]["text"].lstrip().startswith("{")


async def test_a_schema_vllm_refuses_is_400_from_the_worker(
    cluster: LocalCluster, http: httpx.AsyncClient
) -> None:
    body = {
        "model": served_model(cluster),
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "response_format": json_schema({"type": "no-such-type"}),
    }
    reply = await http.post("/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "no-such-type" in error["message"], error


async def test_a_structured_continuation_is_refused_with_its_reason(
    cluster: LocalCluster,
) -> None:
    """What a migrated request's next attempt would bring: the prompt followed by the three
    tokens delivered, sampling on at offset 3. vLLM's grammar cannot take it up there."""
    bus, seen = await observe(cluster.nats_url)
    try:
        prompt = (*PROMPTS[1], 40, 41, 42)
        spec = RequestSpec(
            model=served_model(cluster),
            prompt_token_ids=prompt,
            block_size=32,
            block_hashes=(),
            sampling=SamplingParams(
                max_tokens=8,
                offset=3,
                structured_output=StructuredOutput(
                    type="json_schema", json_schema=json.dumps(COLOUR)
                ),
            ),
            reply_to="test",
            deadline=datetime.now(UTC) + timedelta(minutes=1),
            attempt=1,
        )
        accepted = RequestAccepted(source="ingress/test", request_id="continued", spec=spec)
        await bus.publish(Subjects.request_accepted, accepted)
        failed = await eventually(
            lambda: seen.of(RequestFailed, "continued"), timeout=60, message="no RequestFailed"
        )
    finally:
        await bus.close()
    (event,) = failed
    assert isinstance(event, RequestFailed) and event.code == "invalid_request"
    assert "cannot resume its structured output mid-answer" in event.message, event.message
