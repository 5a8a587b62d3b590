"""The OpenAI-compatible HTTP API: a Starlette app that turns client requests into RequestSpecs,
hands them to a :class:`Gateway`, and writes the events it yields back as OpenAI responses.

The two completion endpoints are raw ASGI apps rather than request/response handlers: they need
``receive`` and ``send`` themselves, to notice a client leaving while the cluster is still
working and to stream without an extra task per response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from schemas.block_hash import chain_block_hashes
from schemas.events import (
    RequestFinished,
    RequestSpec,
    SamplingParams,
    TokensGenerated,
    new_id,
)
from services.common.tokenizer import Tokenizer
from services.ingress.errors import (
    ApiError,
    InvalidRequest,
    from_terminal,
    internal_error,
    model_not_found,
    request_timeout,
)
from services.ingress.gateway import CancelReason, Gateway, GatewayEvent
from services.ingress.metrics import CLIENT_CLOSED_STATUS, CONTENT_TYPE, IngressMetrics
from services.ingress.openai_models import (
    Params,
    parse_chat_request,
    parse_completion_request,
)

log = logging.getLogger(__name__)

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Reverse proxies (nginx) would otherwise buffer the stream and defeat token streaming.
    (b"x-accel-buffering", b"no"),
]
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class IngressApiSettings:
    instance_id: str
    """Ingress instance that the cluster streams answers to (``RequestSpec.reply_to``)."""
    served_model_names: tuple[str, ...] = ("laneway-sim",)
    block_size: int = 16
    """Tokens per block of the prompt's chained block hashes."""
    max_model_len: int = 32768
    """Limit on prompt tokens + max_tokens."""
    default_max_tokens: int = 256
    """max_tokens when the client gives none (less if the context has less room)."""
    request_timeout_s: float = 300.0
    """Seconds from receipt until the request is cancelled and answered with 504."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if min(self.block_size, self.max_model_len, self.default_max_tokens) < 1:
            raise ValueError("block_size, max_model_len and default_max_tokens must be positive")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")


def create_app(gateway: Gateway, tokenizer: Tokenizer, settings: IngressApiSettings) -> Starlette:
    metrics = IngressMetrics()
    endpoints = _Endpoints(settings, metrics)
    routes = [
        Route(
            "/v1/chat/completions",
            _CompletionEndpoint(gateway, tokenizer, settings, metrics, chat=True),
            methods=["POST"],
        ),
        Route(
            "/v1/completions",
            _CompletionEndpoint(gateway, tokenizer, settings, metrics, chat=False),
            methods=["POST"],
        ),
        Route("/v1/models", endpoints.models),
        Route("/health", endpoints.health),
        Route("/metrics", endpoints.metrics),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled_error},
    )


class _Endpoints:
    def __init__(self, settings: IngressApiSettings, metrics: IngressMetrics) -> None:
        created = int(time.time())
        self._models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": created, "owned_by": "laneway"}
                    for name in settings.served_model_names
                ],
            }
        )
        self._metrics = metrics

    async def models(self, request: Request) -> Response:
        return Response(self._models, media_type="application/json")

    async def health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)


class _CompletionEndpoint:
    """``POST /v1/chat/completions`` or ``POST /v1/completions``."""

    def __init__(
        self,
        gateway: Gateway,
        tokenizer: Tokenizer,
        settings: IngressApiSettings,
        metrics: IngressMetrics,
        *,
        chat: bool,
    ) -> None:
        self._gateway = gateway
        self._tokenizer = tokenizer
        self._settings = settings
        self._models = frozenset(settings.served_model_names)
        self._metrics = metrics
        self._chat = chat
        self._name = "chat_completions" if chat else "completions"
        # OpenAI reports an over-long chat prompt against "messages", a completion's against
        # "prompt".
        self._prompt_param = "messages" if chat else "prompt"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = time.perf_counter()
        request = Request(scope, receive)
        try:
            params, prompt_ids = self._parse(await request.body())
            spec = self._spec(params, prompt_ids)
        except ClientDisconnect:
            self._metrics.request_done(self._name, CLIENT_CLOSED_STATUS)
            return
        except ApiError as error:
            self._metrics.request_done(self._name, error.status)
            await _send_json(send, error.status, error.body())
            return
        session_id = request.headers.get("x-session-id") or params.user
        exchange = _Exchange(
            self._gateway, self._metrics, self._name, params, spec, session_id, received
        )
        status = await exchange.run(receive, send, self._settings.request_timeout_s)
        self._metrics.request_done(self._name, status)

    def _parse(self, body: bytes) -> tuple[Params, list[int] | tuple[int, ...]]:
        tokenizer = self._tokenizer
        if self._chat:
            chat = parse_chat_request(body)
            self._check_model(chat.params.model)
            return chat.params, tokenizer.encode(tokenizer.apply_chat_template(chat.messages))
        completion = parse_completion_request(body)
        self._check_model(completion.params.model)
        prompt = completion.prompt
        if isinstance(prompt, str):
            return completion.params, tokenizer.encode(prompt)
        vocab_size = tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in prompt):
            raise InvalidRequest(f"Token ids must be in [0, {vocab_size}).", "prompt")
        return completion.params, prompt

    def _check_model(self, model: str) -> None:
        if model not in self._models:
            raise model_not_found(model)

    def _spec(self, params: Params, prompt_ids: list[int] | tuple[int, ...]) -> RequestSpec:
        settings = self._settings
        prompt_len = len(prompt_ids)
        if not prompt_len:
            raise InvalidRequest("The prompt must contain at least one token.", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            room = settings.max_model_len - prompt_len
            max_tokens = max(1, min(settings.default_max_tokens, room))
        if prompt_len + max_tokens > settings.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {settings.max_model_len} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"{self._prompt_param}, {max_tokens} in the completion). Please reduce the length "
                f"of the {self._prompt_param} or completion.",
                self._prompt_param,
                code="context_length_exceeded",
            )
        prompt_ids = tuple(prompt_ids)
        # Every field was checked above, so pydantic's validation would only cost time here.
        sampling = SamplingParams.model_construct(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop,
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos,
        )
        return RequestSpec.model_construct(
            model=params.model,
            prompt_token_ids=prompt_ids,
            block_size=settings.block_size,
            block_hashes=chain_block_hashes(prompt_ids, settings.block_size),
            sampling=sampling,
            reply_to=settings.instance_id,
            deadline=datetime.now(UTC) + timedelta(seconds=settings.request_timeout_s),
        )


class _ClientGone(Exception):
    pass


class _DisconnectWatch:
    """Cancels the request's task when the client goes away, so that a request waiting on the
    cluster (where no ``send`` would fail) notices at once. ``stop`` must run, synchronously,
    before the task leaves the code that is prepared for that cancellation."""

    __slots__ = ("_task", "_watcher", "fired")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self.fired = False
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass
        self.fired = True
        self._task.cancel()

    def stop(self) -> None:
        self._watcher.cancel()

    def forgive(self) -> None:
        """Undo our own cancellation once it has been handled."""
        self._task.uncancel()


class _Exchange:
    """One request's conversation with the gateway, written to the client as it goes.

    Streaming responses are committed (status 200) only at the first event, so that a request
    that fails before producing anything still gets a proper HTTP error status. A failure after
    that is sent as a final ``data: {"error": {...}}`` event and the stream is closed *without*
    ``data: [DONE]``: a client that only watches for [DONE] then sees a broken stream rather than
    a successful, truncated answer.
    """

    def __init__(
        self,
        gateway: Gateway,
        metrics: IngressMetrics,
        endpoint: str,
        params: Params,
        spec: RequestSpec,
        session_id: str | None,
        received: float,
    ) -> None:
        self._gateway = gateway
        self._metrics = metrics
        self._endpoint = endpoint
        self._params = params
        self._spec = spec
        self._session_id = session_id
        self._received = received
        self._request_id = new_id()
        self._format = _Format(
            chat=endpoint == "chat_completions",
            request_id=self._request_id,
            model=params.model,
            created=int(time.time()),
        )
        self._started = False
        self._first_token = False
        self._ended = False  # the gateway delivered the terminal event

    async def run(self, receive: Receive, send: Send, timeout_s: float) -> int:
        """Serve the request; returns the status for the metrics (499: client went away)."""

        async def send_to_client(message: Message) -> None:
            try:
                await send(message)
            except OSError as error:
                # Servers that implement ASGI 2.4 raise OSError when writing to a gone client.
                raise _ClientGone from error

        watch = _DisconnectWatch(receive)
        events = self._gateway.submit(self._request_id, self._session_id, self._spec)
        self._metrics.in_flight.inc()
        deadline_scope = asyncio.timeout(timeout_s)
        try:
            try:
                async with deadline_scope:
                    return await self._relay(events, send_to_client)
            finally:
                watch.stop()
        except TimeoutError:
            if not deadline_scope.expired():
                return await self._crash(send)
            await self._cancel("timeout")
            return await self._fail(send, request_timeout())
        except asyncio.CancelledError:
            if not watch.fired:
                # Cancelled from outside (server shutdown): the answer will not be read either.
                await self._cancel("client_disconnected")
                raise
            watch.forgive()
            await self._cancel("client_disconnected")
            return CLIENT_CLOSED_STATUS
        except _ClientGone:
            await self._cancel("client_disconnected")
            return CLIENT_CLOSED_STATUS
        except Exception:
            return await self._crash(send)
        finally:
            self._metrics.in_flight.dec()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _relay(self, events: AsyncIterator[GatewayEvent], send: Send) -> int:
        stream = self._params.stream
        texts: list[str] = []
        async for event in events:
            if isinstance(event, TokensGenerated):
                if not self._first_token:
                    self._first_token = True
                    self._metrics.first_token(self._endpoint, time.perf_counter() - self._received)
                if not event.text:
                    continue
                if not stream:
                    texts.append(event.text)
                    continue
                body = self._format.delta(event.text)
                if not self._started:
                    body = await self._start_stream(send) + body
                await send({"type": "http.response.body", "body": body, "more_body": True})
                continue
            self._ended = True
            if not isinstance(event, RequestFinished):
                return await self._fail(send, from_terminal(event))
            if not stream:
                body = self._format.full("".join(texts), event)
                await _send_json(send, 200, body, self._headers(_JSON_HEADERS))
            else:
                body = self._format.closing(event, self._params.include_usage)
                if not self._started:
                    body = await self._start_stream(send) + body
                await send({"type": "http.response.body", "body": body, "more_body": False})
            usage = event.usage
            self._metrics.completed(
                self._endpoint,
                time.perf_counter() - self._received,
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.completion_tokens,
            )
            return 200
        raise RuntimeError("the gateway's events ended without a terminal event")

    async def _start_stream(self, send: Send) -> bytes:
        """Commit to a 200 stream; returns the opening events, to go out with the first body
        (one write fewer per request)."""
        self._started = True
        headers = self._headers(_SSE_HEADERS)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        return self._format.opening()

    def _headers(self, base: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        return [*base, (b"x-request-id", self._request_id.encode())]

    async def _fail(self, send: Send, error: ApiError) -> int:
        try:
            if self._started:
                body = b"data: " + error.body() + b"\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await _send_json(send, error.status, error.body(), self._headers(_JSON_HEADERS))
        except (OSError, _ClientGone):
            return CLIENT_CLOSED_STATUS
        return error.status

    async def _crash(self, send: Send) -> int:
        """Answer an unexpected exception (being handled) with a 500."""
        log.exception("request %s failed", self._request_id)
        # Nobody will read the answer; don't leave a worker generating it.
        await self._cancel("client_disconnected")
        return await self._fail(send, internal_error())

    async def _cancel(self, reason: CancelReason) -> None:
        if self._ended:
            return
        try:
            await self._gateway.cancel(self._request_id, reason)
        except Exception:
            # The request still ends at its deadline; the client must get its answer regardless.
            log.warning("cancelling request %s failed", self._request_id, exc_info=True)


class _Format:
    """OpenAI's response shapes for one request. A streamed text delta is spliced from
    pre-encoded pieces: it is written once per token batch, the hottest line of the ingress."""

    __slots__ = ("_base", "_chat", "_delta_head", "_delta_tail")

    def __init__(self, *, chat: bool, request_id: str, model: str, created: int) -> None:
        self._chat = chat
        self._base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        head = b"data: " + orjson.dumps(self._base)[:-1] + b',"choices":[{"index":0,'
        self._delta_head = head + (b'"delta":{"content":' if chat else b'"text":')
        self._delta_tail = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def delta(self, text: str) -> bytes:
        return self._delta_head + orjson.dumps(text) + self._delta_tail

    def opening(self) -> bytes:
        if not self._chat:
            return b""
        return self._event(choices=[_choice({"delta": {"role": "assistant", "content": ""}}, None)])

    def closing(self, finished: RequestFinished, include_usage: bool) -> bytes:
        last: Mapping[str, object] = {"delta": {}} if self._chat else {"text": ""}
        out = self._event(choices=[_choice(last, finished.finish_reason)])
        if include_usage:
            out += self._event(choices=[], usage=_usage(finished))
        return out + _SSE_DONE

    def full(self, text: str, finished: RequestFinished) -> bytes:
        if self._chat:
            content: Mapping[str, object] = {"message": {"role": "assistant", "content": text}}
        else:
            content = {"text": text}
        return orjson.dumps(
            {
                **self._base,
                "object": "chat.completion" if self._chat else "text_completion",
                "choices": [_choice(content, finished.finish_reason)],
                "usage": _usage(finished),
            }
        )

    def _event(self, **fields: object) -> bytes:
        return b"data: " + orjson.dumps({**self._base, **fields}) + b"\n\n"


def _choice(content: Mapping[str, object], finish_reason: str | None) -> dict[str, object]:
    return {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}


def _usage(finished: RequestFinished) -> dict[str, object]:
    usage = finished.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


async def _send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = _JSON_HEADERS
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.status_code, exc.detail)
    return Response(error.body(), status_code=exc.status_code, media_type="application/json")


async def _unhandled_error(request: Request, exc: Exception) -> Response:
    error = internal_error()
    return Response(error.body(), status_code=error.status, media_type="application/json")
