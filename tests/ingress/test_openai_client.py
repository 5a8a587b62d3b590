"""The official ``openai`` client against the app: the shapes we send are the shapes it parses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.ingress.fakes import Fail, Finish, Step, Tokens
from tests.ingress.helpers import MODEL, Harness, harness

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]


@asynccontextmanager
async def openai_client(
    script: Sequence[Step] | None = None, **settings: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, Harness]]:
    async with harness(script, **settings) as h:
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app))
        client = openai.AsyncOpenAI(
            base_url="http://ingress/v1",
            api_key="x",
            # openai's stubs name only httpx2's client; it takes httpx's as well.
            http_client=http_client,  # type: ignore[arg-type]
            max_retries=0,
        )
        async with client:
            yield client, h


async def test_chat() -> None:
    async with openai_client([Tokens("Hel"), Tokens("lo"), Finish(cached_tokens=16)]) as (
        client,
        h,
    ):
        completion = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0.2
        )
    request_id = h.gateway.submitted[0].request_id
    assert completion.id == f"chatcmpl-{request_id}"
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hello"
    assert choice.finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 16


async def test_chat_stream_with_usage() -> None:
    async with openai_client([Tokens("Hel"), Tokens("lo"), Finish("length")]) as (client, h):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert {c.id for c in chunks} == {f"chatcmpl-{h.gateway.submitted[0].request_id}"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


async def test_completion() -> None:
    async with openai_client() as (client, h):
        completion = await client.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert completion.id == f"cmpl-{h.gateway.submitted[0].request_id}"
    assert completion.choices[0].text == "Hello"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 4


async def test_completion_stream() -> None:
    async with openai_client() as (client, _):
        stream = await client.completions.create(
            model=MODEL, prompt=[1, 2, 3], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 8


async def test_invalid_request() -> None:
    async with openai_client() as (client, _):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=3)
    assert raised.value.status_code == 400
    assert raised.value.param == "temperature"
    assert raised.value.type == "invalid_request_error"


async def test_a_tool_call_asked_for_is_refused_not_answered_with_text() -> None:
    tool: openai.types.chat.ChatCompletionToolParam = {
        "type": "function",
        "function": {"name": "lookup", "parameters": {"type": "object"}},
    }
    async with openai_client() as (client, h):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool])
    assert raised.value.param == "tools"
    assert h.gateway.submitted == []


async def test_models_list_and_retrieve() -> None:
    async with openai_client() as (client, _):
        listed = [m.id async for m in client.models.list()]
        model = await client.models.retrieve(MODEL)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("nope")
    assert listed == [MODEL]
    assert (model.id, model.owned_by) == (MODEL, "laneway")


async def test_context_length_exceeded() -> None:
    async with openai_client(max_model_len=50) as (client, _):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=20)
    assert raised.value.code == "context_length_exceeded"


async def test_unknown_model() -> None:
    async with openai_client() as (client, _):
        with pytest.raises(openai.NotFoundError) as raised:
            await client.completions.create(model="nope", prompt="x")
    assert raised.value.code == "model_not_found"


async def test_no_worker() -> None:
    async with openai_client([Fail("no_worker", "no worker serves laneway-sim")]) as (client, _):
        with pytest.raises(openai.InternalServerError) as raised:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    assert raised.value.status_code == 503
    assert raised.value.code == "no_worker"


async def test_failure_mid_stream() -> None:
    async with openai_client([Tokens("Hel"), Fail("worker_lost", "worker w0 died")]) as (
        client,
        _,
    ):
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="worker w0 died"):
            async for chunk in stream:
                received.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in received) == "Hel"
