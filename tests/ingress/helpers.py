"""Building an app around a FakeGateway, reading its SSE answers, and a live gateway's
requests."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from schemas.events import (
    RequestFinished,
    RequestSpec,
    SamplingParams,
    TokensGenerated,
    Usage,
)
from services.common.tokenizer import ByteTokenizer
from services.ingress.acceptor import EagerAcceptServer
from services.ingress.api import create_app
from services.ingress.gateway import GatewayEvent
from services.ingress.main import IngressSettings, http_config
from services.ingress.metrics import IngressMetrics
from services.ingress.pool_admission import PooledAdmission
from services.ingress.settings import IngressApiSettings
from tests.ingress.fakes import FakeGateway, Step

MODEL = "laneway-sim"


@dataclass
class Harness:
    app: Starlette
    gateway: FakeGateway
    client: httpx.AsyncClient


@asynccontextmanager
async def harness(
    script: Sequence[Step] | None = None,
    *,
    admission: PooledAdmission | None = None,
    metrics: IngressMetrics | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    gateway = FakeGateway() if script is None else FakeGateway(script=script)
    app = create_app(
        gateway,
        ByteTokenizer(),
        IngressApiSettings(instance_id="ingress-1", **settings),
        metrics=metrics,
        admission=admission,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        yield Harness(app, gateway, client)


def sse_data(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    assert body.endswith("\n\n")
    out: list[Any] = []
    for event in body.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def completion_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon", **fields}


def request_spec(reply_to: str, max_tokens: int = 6) -> RequestSpec:
    """A three-token prompt for the ingress instance ``reply_to``, due in a minute."""
    return RequestSpec(
        model="m",
        prompt_token_ids=(1, 2, 3),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_to=reply_to,
        deadline=datetime.now(UTC) + timedelta(minutes=1),
    )


async def collect(events: AsyncIterator[GatewayEvent]) -> list[GatewayEvent]:
    return [event async for event in events]


WORKER_SOURCE = "worker/test"


def batch(index: int, text: str, request_id: str = "r1") -> TokensGenerated:
    return TokensGenerated(
        source=WORKER_SOURCE,
        request_id=request_id,
        worker_id="w0",
        index=index,
        token_ids=tuple(text.encode()),
        text=text,
    )


def finished(completion_tokens: int, request_id: str = "r1") -> RequestFinished:
    return RequestFinished(
        source=WORKER_SOURCE,
        request_id=request_id,
        worker_id="w0",
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=completion_tokens),
        ttft_ms=1.0,
        e2e_ms=2.0,
    )


def text_of(events: list[GatewayEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokensGenerated))


async def ok_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A bare ASGI app answering every HTTP request with 200 "ok": for the server's own tests."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def served(app: ASGIApp, settings: IngressSettings | None = None) -> AsyncIterator[int]:
    """``app`` behind the ingress's own HTTP server and its settings, on a free loopback port
    (yielded), stopped when the block ends."""
    settings = settings or IngressSettings()
    listener = socket.create_server(("127.0.0.1", 0))
    server = EagerAcceptServer(http_config(app, settings))
    server.config.lifespan = "off"
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await serving


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(metrics: IngressMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
