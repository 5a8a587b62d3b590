"""``response_format``: parsed and bounded on both endpoints, refused for a model whose workers
lack structured outputs (naming their engines), carried to the worker in the request's sampling,
and never continued on another worker once the client has part of the answer."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from schemas import codec
from schemas.events import (
    RequestAccepted,
    RequestFailed,
    RequestPlaced,
    SamplingParams,
    StructuredOutput,
)
from schemas.messages import ResendReply
from schemas.plain import to_json
from services.common.tokenizer import ByteTokenizer
from services.engine.protocol import EngineRequest
from services.engine.sim import SimConfig, SimEngine
from services.ingress.api import create_app
from services.ingress.errors import InvalidRequest
from services.ingress.follow import Follow, Recovery
from services.ingress.mailbox import Mailbox
from services.ingress.migration import unresumable
from services.ingress.openai_models import parse_chat_request, parse_completion_request
from services.ingress.response_format import MAX_SCHEMA_BYTES
from services.ingress.settings import IngressApiSettings
from services.ingress.worker_features import WorkerFeatures
from tests.ingress.fakes import FakeGateway
from tests.ingress.features import features_of, intake, worker
from tests.ingress.helpers import MODEL, batch, chat_body, collect, request_spec

# Property order is the client's: the answer gives them in that order.
SCHEMA = {
    "type": "object",
    "properties": {"zeta": {"enum": ["a", "b"]}, "alpha": {"type": "integer"}},
    "required": ["zeta", "alpha"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def completion(**fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": "Hi", **fields})


def chat(**fields: Any) -> bytes:
    return orjson.dumps(chat_body(**fields))


@pytest.mark.parametrize("parse", [parse_chat_request, parse_completion_request])
def test_json_schema_and_json_object_are_taken_on_both_endpoints(parse: Any) -> None:
    body = chat if parse is parse_chat_request else completion
    wanted = parse(body(response_format=JSON_SCHEMA)).params.structured_output
    assert wanted == StructuredOutput(type="json_schema", json_schema=orjson.dumps(SCHEMA).decode())
    assert wanted.json_schema.index('"zeta"') < wanted.json_schema.index('"alpha"')
    strict = {**JSON_SCHEMA["json_schema"], "strict": True, "description": "d"}  # type: ignore[dict-item]
    assert parse(body(response_format={"type": "json_schema", "json_schema": strict}))
    assert parse(body(response_format={"type": "json_object"})).params.structured_output == (
        StructuredOutput(type="json_object")
    )
    assert parse(body(response_format={"type": "text"})).params.structured_output is None
    assert parse(body()).params.structured_output is None


def _schema(**fields: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, **fields}}


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ("json", "response_format"),
        ({"type": "xml"}, "response_format.type"),
        ({}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": []}, "response_format.json_schema"),
        (_schema(name=None), "response_format.json_schema.name"),
        (_schema(name=3), "response_format.json_schema.name"),
        (_schema(name="has space"), "response_format.json_schema.name"),
        (_schema(name="x\n"), "response_format.json_schema.name"),
        (_schema(name="n" * 65), "response_format.json_schema.name"),
        (_schema(schema=None), "response_format.json_schema.schema"),
        (_schema(schema="{}"), "response_format.json_schema.schema"),
        (_schema(schema=[{"type": "string"}]), "response_format.json_schema.schema"),
        (_schema(strict="yes"), "response_format.json_schema.strict"),
        (
            _schema(schema={"enum": ["x" * MAX_SCHEMA_BYTES]}),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_bad_response_format_is_400_naming_its_field(response_format: object, param: str) -> None:
    for parse, body in ((parse_chat_request, chat), (parse_completion_request, completion)):
        with pytest.raises(InvalidRequest) as refused:
            parse(body(response_format=response_format))
        assert refused.value.param == param, refused.value.message
        assert refused.value.status == 400


def test_a_schema_just_within_the_bound_is_taken() -> None:
    room = MAX_SCHEMA_BYTES - len(orjson.dumps({"enum": [""]}))
    wanted = parse_completion_request(
        completion(response_format=_schema(schema={"enum": ["x" * room]}))
    ).params.structured_output
    assert wanted is not None and len(wanted.json_schema or "") == MAX_SCHEMA_BYTES


async def test_a_model_served_by_an_engine_without_structured_outputs_refuses_it() -> None:
    sims = await features_of(worker("s1", "sim", False), worker("s2", "sim", False))
    with pytest.raises(InvalidRequest) as refused:
        intake(sims).spec(parse_chat_request(chat(response_format=JSON_SCHEMA)))
    assert refused.value.param == "response_format"
    assert refused.value.message == (
        "response_format json_schema needs workers whose engine does structured outputs "
        f"(vllm); model '{MODEL}' is served by sim."
    )
    # Free text is served as ever.
    assert intake(sims).spec(parse_chat_request(chat(response_format={"type": "text"})))
    # One worker without it is enough to refuse: the planner may pick it.
    mixed = await features_of(worker("v", "vllm", True), worker("t", "torch", False))
    with pytest.raises(InvalidRequest) as refused:
        intake(mixed).spec(parse_completion_request(completion(response_format=_schema())))
    assert refused.value.message.endswith("is served by torch as well as vllm.")
    with pytest.raises(InvalidRequest, match="response_format json_object needs"):
        intake(mixed).spec(parse_chat_request(chat(response_format={"type": "json_object"})))


async def test_workers_that_do_structured_outputs_get_the_schema_in_the_sampling() -> None:
    # Another model's workers do not count; those of this one all have it.
    features = await features_of(
        worker("v1", "vllm", True), worker("v2", "vllm", True), worker("s", "sim", False, "other")
    )
    spec = intake(features).spec(parse_chat_request(chat(response_format=JSON_SCHEMA)))
    wanted = spec.sampling.structured_output
    assert wanted is not None and orjson.loads(wanted.json_schema or "") == SCHEMA
    # Built unvalidated (schemas.trusted), it is what validation builds.
    assert type(spec).model_validate_json(spec.model_dump_json()) == spec
    # A worker that leaves takes its refusal along: the sim worker is gone, vLLM's stay.
    before = await features_of(worker("v1", "vllm", True), worker("s", "sim", False))
    with pytest.raises(InvalidRequest):
        intake(before).spec(parse_chat_request(chat(response_format=JSON_SCHEMA)))
    await before.on_workers({"v1": worker("v1", "vllm", True)})
    assert intake(before).spec(parse_chat_request(chat(response_format=JSON_SCHEMA)))


async def test_with_no_worker_registered_the_engine_decides() -> None:
    spec = intake(WorkerFeatures()).spec(parse_chat_request(chat(response_format=JSON_SCHEMA)))
    assert spec.sampling.structured_output is not None


async def test_the_api_answers_the_refusal_in_openais_shape() -> None:
    gateway = FakeGateway()
    features = await features_of(worker("s", "sim", False))
    app = create_app(
        gateway,
        ByteTokenizer(),
        IngressApiSettings(instance_id="i"),
        worker_features=features,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = chat_body(response_format=JSON_SCHEMA)
            if path == "/v1/completions":
                body = {"model": MODEL, "prompt": "Hi", "response_format": JSON_SCHEMA}
            response = await client.post(path, json=body)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "response_format"
            assert error["type"] == "invalid_request_error"
            assert "served by sim" in error["message"]
        assert not gateway.submitted
        await features.on_workers({"v": worker("v", "vllm", True)})
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    (submitted,) = gateway.submitted
    assert submitted.spec.sampling.structured_output is not None


def test_the_sampling_field_is_additive_and_travels_intact() -> None:
    spec = request_spec("i").model_copy(
        update={
            "sampling": SamplingParams(
                max_tokens=4,
                structured_output=StructuredOutput(
                    type="json_schema", json_schema='{"enum":["é","\\u0000"]}'
                ),
            )
        }
    )
    event = RequestAccepted(source="ingress/i", request_id="r", spec=spec)
    encoded = codec.encode(event)
    assert codec.decode_event(encoded) == event
    # orjson's writing of it is pydantic's, byte for byte.
    assert to_json(event) == event.__pydantic_serializer__.to_json(event)
    # An event from before the field: free text.
    raw = orjson.loads(encoded)
    del raw["spec"]["sampling"]["structured_output"]
    old = codec.decode_event(orjson.dumps(raw))
    assert isinstance(old, RequestAccepted) and old.spec.sampling.structured_output is None


def test_engines_without_structured_outputs_refuse_it_themselves() -> None:
    engine = SimEngine(SimConfig(block_size=16, num_gpu_blocks=64))
    assert not engine.capabilities.structured_outputs
    wanted = SamplingParams(max_tokens=4, structured_output=StructuredOutput(type="json_object"))
    with pytest.raises(ValueError, match="response_format json_object, and the sim engine does"):
        engine.add_request(EngineRequest("r", (1, 2, 3), wanted))
    assert not engine.has_work()
    engine.add_request(EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=4)))


STRUCTURED = StructuredOutput(type="json_object")


def test_a_structured_answer_under_way_cannot_move() -> None:
    spec = request_spec("i")
    structured = spec.model_copy(
        update={"sampling": spec.sampling.model_copy(update={"structured_output": STRUCTURED})}
    )
    assert unresumable(spec, 3, "r", None, "ingress/i") is None
    # Before its first token the request starts afresh elsewhere, grammar and all.
    assert unresumable(structured, 0, "r", None, "ingress/i") is None
    failed = unresumable(structured, 3, "r", "s", "ingress/i")
    assert failed is not None and failed.code == "worker_lost"
    assert failed.completion_tokens == 3 and "cannot continue on another worker" in failed.message


async def test_a_followed_structured_request_whose_worker_goes_silent_fails_once() -> None:
    """Its worker sends two tokens and is heard from no more: no continuation is submitted, the
    client gets the tokens and one error."""
    spec = request_spec("t")
    spec = spec.model_copy(
        update={"sampling": spec.sampling.model_copy(update={"structured_output": STRUCTURED})}
    )
    queue = Mailbox()
    for event in (
        RequestPlaced(source="planner/t", request_id="r1", worker_id="w1", attempt=0),
        batch(0, "ab").model_copy(update={"worker_id": "w1"}),
    ):
        queue.put_nowait(event)
    resubmitted: list[RequestAccepted] = []

    async def resend(_: str, worker: str, index: int, attempt: int) -> ResendReply | None:
        return None

    async def resubmit(moved: RequestAccepted) -> None:
        resubmitted.append(moved)

    accepted = RequestAccepted(source="ingress/t", request_id="r1", spec=spec)
    fast = Recovery(completion_wait_s=0.2, silence_s=0.05, orphan_s=0.3, unrouted_s=0.3)
    out = Follow(accepted, queue, fast, resend, resubmit, "ingress/t")
    events = await asyncio.wait_for(collect(out.events()), 5)
    assert [type(e).__name__ for e in events] == ["TokensGenerated", "RequestFailed"]
    failed = events[-1]
    assert isinstance(failed, RequestFailed) and failed.code == "worker_lost"
    assert "response_format json_object" in failed.message
    assert not resubmitted
