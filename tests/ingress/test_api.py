from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import FailureCode
from services.common.tokenizer import ByteTokenizer
from services.ingress.api import create_app
from services.ingress.main import IngressSettings
from services.ingress.openai_models import MAX_MESSAGES, MAX_STOP_TOKEN_IDS, Message
from services.ingress.settings import IngressApiSettings
from tests.helpers import eventually
from tests.ingress.fakes import Fail, FakeGateway, Finish, Hang, Raise, Step, Tokens
from tests.ingress.helpers import MODEL, chat_body, completion_body, harness, sse_data


async def test_chat_completion() -> None:
    async with harness([Tokens("Hel"), Tokens(""), Tokens("lo"), Finish(cached_tokens=16)]) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    body = response.json()
    (submitted,) = h.gateway.submitted
    assert response.headers["x-request-id"] == submitted.request_id
    prompt_tokens = len(submitted.spec.prompt_token_ids)
    assert body == {
        "id": f"chatcmpl-{submitted.request_id}",
        "object": "chat.completion",
        "created": body["created"],
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 5,
            "total_tokens": prompt_tokens + 5,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
    }
    assert abs(body["created"] - time.time()) < 5
    assert h.gateway.closed == [submitted.request_id]
    assert h.gateway.cancelled == []


async def test_request_spec() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    fields = {
        "messages": messages,
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "seed": 42,
        "stop": "\n",
        "stop_token_ids": [3],
        "ignore_eos": True,
        "user": "alice",
        "frequency_penalty": 0.5,
        "some_future_field": {"x": 1},
    }
    async with harness(block_size=4, request_timeout_s=60) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(**fields))
    assert response.status_code == 200, response.text
    (submitted,) = h.gateway.submitted
    spec = submitted.spec
    tokenizer = ByteTokenizer()
    expected_prompt = tokenizer.encode(
        tokenizer.apply_chat_template([Message("system", "Be brief."), Message("user", "a\nb")])
    )
    assert spec.prompt_token_ids == tuple(expected_prompt)
    assert spec.block_size == 4
    assert spec.block_hashes == chain_block_hashes(expected_prompt, 4)
    assert spec.model == MODEL
    assert spec.reply_to == "ingress-1"
    expected_deadline = datetime.now(UTC) + timedelta(seconds=60)
    assert abs((spec.deadline - expected_deadline).total_seconds()) < 5
    sampling = spec.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (7, 0.0, 0.5)
    assert (sampling.seed, sampling.stop, sampling.stop_token_ids) == (42, ("\n",), (3,))
    assert sampling.ignore_eos
    # The unvalidated construction must still serialize as the real thing.
    assert type(spec).model_validate_json(spec.model_dump_json()) == spec
    assert submitted.session_id == "alice"


async def test_session_id_header_wins_over_user() -> None:
    async with harness() as h:
        await h.client.post(
            "/v1/chat/completions", json=chat_body(user="bob"), headers={"x-session-id": "s1"}
        )
        await h.client.post("/v1/completions", json=completion_body())
    assert [s.session_id for s in h.gateway.submitted] == ["s1", None]


async def test_max_completion_tokens_wins_over_max_tokens() -> None:
    async with harness() as h:
        body = chat_body(max_tokens=5, max_completion_tokens=9)
        await h.client.post("/v1/chat/completions", json=body)
    assert h.gateway.submitted[0].spec.sampling.max_tokens == 9


async def test_default_max_tokens_fits_the_context() -> None:
    async with harness(max_model_len=20, default_max_tokens=8) as h:
        await h.client.post("/v1/completions", json=completion_body(prompt="x" * 4))
        await h.client.post("/v1/completions", json=completion_body(prompt="x" * 15))
    assert [s.spec.sampling.max_tokens for s in h.gateway.submitted] == [8, 5]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream(include_usage: bool) -> None:
    script: list[Step] = [Tokens("Hel"), Tokens(""), Tokens("lo"), Finish("length")]
    async with harness(script) as h:
        body = chat_body(stream=True, stream_options={"include_usage": include_usage})
        response = await h.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_data(response.text)
    (submitted,) = h.gateway.submitted
    head = {
        "id": f"chatcmpl-{submitted.request_id}",
        "object": "chat.completion.chunk",
        "created": events[0]["created"],
        "model": MODEL,
        # Asked for, the usage is null in every chunk before its own.
        **({"usage": None} if include_usage else {}),
    }

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    expected: list[Any] = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "length"),
    ]
    if include_usage:
        prompt_tokens = len(submitted.spec.prompt_token_ids)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 5,
            "total_tokens": prompt_tokens + 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        expected.append({**head, "choices": [], "usage": usage})
    assert events == [*expected, "[DONE]"]
    assert h.gateway.closed == [submitted.request_id]


async def test_completion() -> None:
    async with harness() as h:
        response = await h.client.post("/v1/completions", json=completion_body())
    (submitted,) = h.gateway.submitted
    assert submitted.spec.prompt_token_ids == tuple(b"Once upon")
    assert response.json() == {
        "id": f"cmpl-{submitted.request_id}",
        "object": "text_completion",
        "created": response.json()["created"],
        "model": MODEL,
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 5,
            "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


@pytest.mark.parametrize(
    ("prompt", "token_ids"),
    [(["ab"], (97, 98)), ([5, 6, 7], (5, 6, 7)), ([[5, 6]], (5, 6)), ("é", (195, 169))],
)
async def test_completion_prompt_forms(prompt: Any, token_ids: tuple[int, ...]) -> None:
    async with harness() as h:
        response = await h.client.post("/v1/completions", json=completion_body(prompt=prompt))
    assert response.status_code == 200
    assert h.gateway.submitted[0].spec.prompt_token_ids == token_ids


async def test_completion_stream() -> None:
    async with harness() as h:
        body = completion_body(stream=True, stream_options={"include_usage": True})
        response = await h.client.post("/v1/completions", json=body)
    events = sse_data(response.text)
    (submitted,) = h.gateway.submitted
    head = {
        "id": f"cmpl-{submitted.request_id}",
        "object": "text_completion",
        "created": events[0]["created"],
        "model": MODEL,
        "usage": None,
    }

    def chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 5,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert events == [
        chunk("Hel"),
        chunk("lo"),
        chunk("", "stop"),
        {**head, "choices": [], "usage": usage},
        "[DONE]",
    ]


async def test_stream_without_tokens_still_opens_and_finishes() -> None:
    async with harness([Finish()]) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_data(response.text)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, "stop"]
    assert events[-1] == "[DONE]"


BAD_CHAT = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"model": MODEL}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    (chat_body(messages=[]), "messages"),
    (chat_body(messages="hi"), "messages"),
    (chat_body(messages=["hi"]), "messages[0]"),
    (chat_body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (chat_body(messages=[{"role": "user"}]), "messages[0].content"),
    (
        chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].type",
    ),
    (
        chat_body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (chat_body(temperature=2.5), "temperature"),
    (chat_body(temperature=-0.1), "temperature"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(top_p=1.5), "top_p"),
    (chat_body(n=2), "n"),
    (chat_body(n="1"), "n"),
    (chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat_body(stop=[1]), "stop"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_tokens=1.5), "max_tokens"),
    (chat_body(max_tokens=True), "max_tokens"),
    (chat_body(max_completion_tokens=-1), "max_completion_tokens"),
    (chat_body(seed="x"), "seed"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (chat_body(logprobs="yes"), "logprobs"),
    (chat_body(user=7), "user"),
    (chat_body(stop_token_ids=[-1]), "stop_token_ids[0]"),
    (chat_body(stop_token_ids=["1"]), "stop_token_ids"),
    (chat_body(seed=2**63), "seed"),
    (chat_body(seed=-(2**63) - 1), "seed"),
    (chat_body(seed=1e23), "seed"),
    (chat_body(top_logprobs=2), "top_logprobs"),  # without logprobs
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=1.5), "top_logprobs"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat_body(tool_choice="required"), "tool_choice"),
    (chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat_body(functions=[{"name": "f"}]), "functions"),
    (chat_body(function_call="auto"), "function_call"),
    (chat_body(response_format={"type": "xml"}), "response_format.type"),
    (chat_body(response_format="json"), "response_format"),
    (chat_body(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (chat_body(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)), "messages"),
    (chat_body(ignore_eos="no"), "ignore_eos"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
async def test_chat_invalid_request(body: Any, param: str | None) -> None:
    async with harness() as h:
        if isinstance(body, bytes):
            response = await h.client.post("/v1/chat/completions", content=body)
        else:
            response = await h.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert h.gateway.submitted == []


BAD_COMPLETION = [
    ({"model": MODEL}, "prompt"),
    (completion_body(prompt=["a", "b"]), "prompt"),
    (completion_body(prompt=[]), "prompt"),
    (completion_body(prompt=[1, "a"]), "prompt"),
    (completion_body(prompt=[-1]), "prompt"),
    (completion_body(prompt=[257]), "prompt"),
    (completion_body(prompt=""), "prompt"),
    (completion_body(prompt=5), "prompt"),
    (completion_body(echo=True), "echo"),
    (completion_body(best_of=3), "best_of"),
    (completion_body(logprobs=21), "logprobs"),
    (completion_body(logprobs=-1), "logprobs"),
    (completion_body(logprobs=True), "logprobs"),
    (completion_body(suffix="x"), "suffix"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION)
async def test_completion_invalid_request(body: Any, param: str) -> None:
    async with harness() as h:
        response = await h.client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_harmless_fields_are_accepted() -> None:
    fields = {
        "n": 1,
        "logprobs": False,
        "presence_penalty": 1,
        "logit_bias": {"1": 2},
        # A tool list that asks for no call, plain text: what the engine does anyway.
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "seed": 2**63 - 1,
    }
    async with harness() as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(**fields))
        completion = await h.client.post("/v1/completions", json=completion_body(suffix=""))
    assert response.status_code == 200, response.text
    assert completion.status_code == 200, completion.text


async def test_unknown_model() -> None:
    async with harness() as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "gpt-9" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(max_tokens=100), "messages"),
        ("/v1/completions", completion_body(prompt="x" * 101), "prompt"),
    ],
)
async def test_context_length_exceeded(path: str, body: Any, param: str) -> None:
    async with harness(max_model_len=100) as h:
        response = await h.client.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert "maximum context length is 100 tokens" in error["message"]


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        ("no_worker", 503, "service_unavailable_error"),
        ("worker_lost", 502, "server_error"),
        ("incomplete_stream", 502, "server_error"),
        ("engine_error", 500, "server_error"),
        ("invalid_request", 400, "invalid_request_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_first_token(
    code: FailureCode, status: int, error_type: str, stream: bool
) -> None:
    async with harness([Fail(code, "sorry")]) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert response.status_code == status
    assert response.json() == {
        "error": {"message": "sorry", "type": error_type, "param": None, "code": code}
    }
    assert h.gateway.closed == [h.gateway.submitted[0].request_id]


async def test_stream_failure_after_first_token_ends_with_error_event() -> None:
    async with harness([Tokens("Hel"), Fail("worker_lost", "gone")]) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(stream=True))
    assert response.status_code == 200
    events = sse_data(response.text)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
    ]
    assert events[2:] == [
        {"error": {"message": "gone", "type": "server_error", "param": None, "code": "worker_lost"}}
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_timeout(stream: bool) -> None:
    async with harness([Hang()], request_timeout_s=0.05) as h:
        response = await h.client.post("/v1/completions", json=completion_body(stream=stream))
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    (submitted,) = h.gateway.submitted
    assert h.gateway.cancelled == [(submitted.request_id, "timeout")]
    assert h.gateway.closed == [submitted.request_id]


async def test_timeout_after_stream_started() -> None:
    async with harness([Tokens("a"), Hang()], request_timeout_s=0.05) as h:
        response = await h.client.post("/v1/completions", json=completion_body(stream=True))
    assert response.status_code == 200
    events = sse_data(response.text)
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["code"] == "timeout"
    assert len(events) == 2
    assert h.gateway.cancelled == [(h.gateway.submitted[0].request_id, "timeout")]


async def test_gateway_error_is_a_500() -> None:
    async with harness([Tokens("a"), Raise(ConnectionError("bus down"))]) as h:
        response = await h.client.post("/v1/completions", json=completion_body())
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    (submitted,) = h.gateway.submitted
    assert h.gateway.cancelled == [(submitted.request_id, "client_disconnected")]


class _BrokenTokenizer(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        raise RuntimeError("tokenizer broke")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_an_unexpected_error_before_the_answer_is_an_openai_500(path: str) -> None:
    # The completion paths skip Starlette's error middleware: they answer as it would.
    app = create_app(FakeGateway(), _BrokenTokenizer(), IngressApiSettings(instance_id="i"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        body = chat_body() if "chat" in path else completion_body()
        response = await client.post(path, json=body)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"


async def test_events_ending_without_terminal_is_a_500() -> None:
    async with harness([Tokens("a")]) as h:
        response = await h.client.post("/v1/completions", json=completion_body())
    assert response.status_code == 500


async def test_cancellation_decided_elsewhere() -> None:
    async with harness([Hang()]) as h:
        task = asyncio.ensure_future(h.client.post("/v1/completions", json=completion_body()))
        await eventually(lambda: h.gateway.submitted, interval=0.001)
        await h.gateway.cancel(h.gateway.submitted[0].request_id, "timeout")
        response = await task
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "cancelled"


async def test_models_health_and_unknown_paths() -> None:
    async with harness(served_model_names=("a", "b")) as h:
        models = (await h.client.get("/v1/models")).json()
        one = await h.client.get("/v1/models/b")
        slash = await h.client.get("/v1/models/")
        unknown = await h.client.get("/v1/models/gpt-9")
        health = await h.client.get("/health")
        missing = await h.client.get("/v2/nothing")
        wrong_method = await h.client.get("/v1/chat/completions")
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        ("a", "model", "laneway"),
        ("b", "model", "laneway"),
    ]
    assert one.status_code == 200 and one.json() == models["data"][1]
    assert slash.status_code == 200 and slash.json() == models
    assert unknown.status_code == 404
    assert (unknown.json()["error"]["code"], unknown.json()["error"]["param"]) == (
        "model_not_found",
        "model",
    )
    assert health.json() == {"status": "ok"}
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"]
    assert wrong_method.headers["allow"] == "POST"


async def test_metrics() -> None:
    async with harness() as h:
        await h.client.post("/v1/chat/completions", json=chat_body())
        await h.client.post("/v1/chat/completions", json=chat_body(stream=True))
        await h.client.post("/v1/completions", json=completion_body(n=3))
        response = await h.client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    lines = set(text.splitlines())
    assert 'laneway_ingress_requests_total{endpoint="chat_completions",status="200"} 2.0' in lines
    assert 'laneway_ingress_requests_total{endpoint="completions",status="400"} 1.0' in lines
    assert "laneway_ingress_requests_in_flight 0.0" in lines
    assert f'laneway_ingress_completion_tokens_total{{model="{MODEL}",tenant="-"}} 10.0' in lines
    chat = f'endpoint="chat_completions",model="{MODEL}"'
    assert f"laneway_ingress_ttft_seconds_count{{{chat}}} 2.0" in lines
    assert f"laneway_ingress_e2e_latency_seconds_count{{{chat}}} 2.0" in lines


async def test_apps_do_not_share_metrics() -> None:
    async with harness() as first, harness() as second:
        await first.client.post("/v1/completions", json=completion_body())
        text = (await second.client.get("/metrics")).text
    assert "laneway_ingress_requests_total{" not in text


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        IngressApiSettings(instance_id="i", block_size=0)
    with pytest.raises(ValueError):
        IngressApiSettings(instance_id="i", served_model_names=())
    with pytest.raises(ValueError):
        IngressApiSettings(instance_id="i", max_body_bytes=0)


def test_process_settings_reach_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_SERVED_MODEL_NAMES", '["a", "b"]')
    monkeypatch.setenv("LANEWAY_BLOCK_SIZE", "64")
    monkeypatch.setenv("LANEWAY_REQUEST_TIMEOUT_S", "7")
    monkeypatch.setenv("LANEWAY_MAX_BODY_BYTES", "1000")
    api = IngressSettings(instance_id="i").api()
    assert api == IngressApiSettings(
        instance_id="i",
        served_model_names=("a", "b"),
        block_size=64,
        request_timeout_s=7,
        max_body_bytes=1000,
    )
