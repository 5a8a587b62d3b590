"""Clients that leave early, driven through raw ASGI: httpx's transport cannot disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import orjson
from starlette.types import Message

from services.common.tokenizer import ByteTokenizer
from services.ingress.api import create_app
from services.ingress.settings import IngressApiSettings
from tests.helpers import eventually
from tests.ingress.fakes import FakeGateway, Finish, Hang, Step, Tokens
from tests.ingress.helpers import chat_body, completion_body


class Client:
    """Sends one request, then disconnects when ``leave`` is set; ``on_send`` sees every
    message the app sends and may raise, as an ASGI 2.4 server does for a gone client."""

    def __init__(self, script: list[Step], on_send: Callable[[Message], None] | None = None):
        self.gateway = FakeGateway(script=script)
        self.app = create_app(
            self.gateway, ByteTokenizer(), IngressApiSettings(instance_id="ingress-1")
        )
        self.leave = asyncio.Event()
        self.sent: list[Message] = []
        self._on_send = on_send

    async def call(self, path: str, body: dict[str, Any]) -> None:
        messages = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop()
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            self.sent.append(message)
            if self._on_send is not None:
                self._on_send(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000),
            "server": ("ingress", 80),
        }
        await self.app(scope, receive, send)

    async def metrics(self) -> str:
        sent: list[Message] = []

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "GET",
            "path": "/metrics",
            "headers": [],
            "query_string": b"",
        }
        await self.app(scope, receive, send)
        return str(sent[-1]["body"].decode())


async def test_disconnect_while_waiting_cancels_the_request() -> None:
    client = Client([Hang()])
    call = asyncio.create_task(client.call("/v1/chat/completions", chat_body()))
    await eventually(lambda: client.gateway.submitted, interval=0.001)
    client.leave.set()
    await call
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.cancelled == [(request_id, "client_disconnected")]
    assert client.gateway.closed == [request_id]
    assert client.sent == []
    metrics = await client.metrics()
    assert 'laneway_ingress_requests_total{endpoint="chat_completions",status="499"} 1.0' in metrics
    assert "laneway_ingress_requests_in_flight 0.0" in metrics


async def test_disconnect_mid_stream_cancels_the_request() -> None:
    def leave_after_first_text(message: Message) -> None:
        if b'"text":"a"' in message.get("body", b""):
            client.leave.set()

    client = Client([Tokens("a"), Hang()], on_send=leave_after_first_text)
    await client.call("/v1/completions", completion_body(stream=True))
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.cancelled == [(request_id, "client_disconnected")]
    assert client.gateway.closed == [request_id]
    assert all(m.get("more_body", True) for m in client.sent)


async def test_failed_write_cancels_the_request() -> None:
    def fail_after_first_text(message: Message) -> None:
        if b'"text":"a"' in message.get("body", b""):
            raise OSError("connection reset")

    client = Client([Tokens("a"), Tokens("b"), Finish()], on_send=fail_after_first_text)
    await client.call("/v1/completions", completion_body(stream=True))
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.cancelled == [(request_id, "client_disconnected")]
    assert client.gateway.closed == [request_id]


async def test_disconnect_after_the_answer_changes_nothing() -> None:
    def leave_when_answered(message: Message) -> None:
        if message.get("more_body") is False:
            client.leave.set()

    client = Client([Tokens("a"), Finish()], on_send=leave_when_answered)
    await client.call("/v1/completions", completion_body())
    await asyncio.sleep(0.01)
    assert client.gateway.cancelled == []
    assert client.sent[0]["status"] == 200
    metrics = await client.metrics()
    assert 'laneway_ingress_requests_total{endpoint="completions",status="200"} 1.0' in metrics


async def test_server_shutdown_cancels_the_request_and_says_so() -> None:
    """The server's grace for requests in flight ran out: it cancels their tasks. The worker
    stops, and the client gets a 503 it can retry on, not a cut connection."""
    client = Client([Hang()])
    call = asyncio.create_task(client.call("/v1/completions", completion_body(stream=True)))
    await eventually(lambda: client.gateway.submitted, interval=0.001)
    call.cancel()
    await call
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.cancelled == [(request_id, "client_disconnected")]
    assert client.gateway.closed == [request_id]
    assert client.sent[0]["status"] == 503
    assert orjson.loads(client.sent[1]["body"])["error"]["code"] == "server_stopping"
    metrics = await client.metrics()
    assert 'laneway_ingress_requests_total{endpoint="completions",status="503"} 1.0' in metrics


async def test_server_shutdown_mid_stream_ends_it_with_an_error_event() -> None:
    client = Client([Tokens("a"), Hang()])
    call = asyncio.create_task(client.call("/v1/completions", completion_body(stream=True)))
    await eventually(lambda: len(client.sent) >= 2, interval=0.001)
    call.cancel()
    await call
    last = client.sent[-1]
    assert last["more_body"] is False and b'"code":"server_stopping"' in last["body"]
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.cancelled == [(request_id, "client_disconnected")]


async def test_a_second_cancel_leaves_at_once() -> None:
    client = Client([Hang()])
    call = asyncio.create_task(client.call("/v1/completions", completion_body(stream=True)))
    await eventually(lambda: client.gateway.submitted, interval=0.001)
    call.cancel()
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert call.cancelled()
    request_id = client.gateway.submitted[0].request_id
    assert client.gateway.closed == [request_id]
