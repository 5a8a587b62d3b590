"""The OpenAI-compatible HTTP API: a Starlette app that turns client requests into RequestSpecs,
hands them to a :class:`Gateway`, and writes the events it yields back as OpenAI responses.

The two completion endpoints are raw ASGI apps rather than request/response handlers: they need
``receive`` and ``send`` themselves, to notice a client leaving while the cluster is still
working and to stream without an extra task per response. A completion request goes to its
endpoint (behind the API-key gate) straight from the server, not through Starlette's middleware
and router, which every other path takes: the hottest path pays for none of those layers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.tokenizer import Tokenizer
from services.ingress.access_log import log_request
from services.ingress.adapters import AdapterEndpoints, Adapters
from services.ingress.admission import AdmissionSettings
from services.ingress.auth import (
    CACHE_SALT,
    TENANT,
    TENANT_WEIGHT,
    USED_TOKENS,
    AuthGate,
    KeyBook,
    capped,
    check_prompt_quota,
)
from services.ingress.body import read_json_body, request_headers
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.errors import ApiError, internal_error, model_not_found
from services.ingress.exchange import Endpoint, Exchange
from services.ingress.gateway import Gateway
from services.ingress.health import Readiness
from services.ingress.intake import Intake
from services.ingress.metrics import CLIENT_CLOSED_STATUS, CONTENT_TYPE, IngressMetrics
from services.ingress.openai_models import (
    MAX_MODEL_CHARS,
    ParsedRequest,
    parse_chat_request,
    parse_completion_request,
    request_priority,
    session_id,
)
from services.ingress.openapi import openapi_document
from services.ingress.pool_admission import PooledAdmission, pooled
from services.ingress.responses import (
    JSON_HEADERS,
    ChatFormat,
    CompletionFormat,
    Format,
    send_json,
)
from services.ingress.settings import IngressApiSettings
from services.ingress.worker_features import WorkerFeatures

_JSON = "application/json"


def create_app(
    gateway: Gateway,
    tokenizer: Tokenizer,
    settings: IngressApiSettings,
    worker_limit: WorkerContextLimit | None = None,
    metrics: IngressMetrics | None = None,
    admission: PooledAdmission | None = None,
    keys: KeyBook | None = None,
    readiness: Readiness | None = None,
    worker_features: WorkerFeatures | None = None,
    adapters: AdapterEndpoints | None = None,
) -> Starlette:
    """``worker_limit``: the context limit of the registered workers (none: only the settings');
    ``worker_features``: what they can do (none: the ingress refuses nothing for want of it);
    ``adapters``: where LoRA adapters are loaded and unloaded (none: no adapters, and no such
    endpoints);
    ``metrics``: where the app counts (none: a registry of its own, served at ``/metrics``);
    ``keys``: the API keys every request but ``/health`` must bring (none: no keys asked)."""
    metrics = metrics or IngressMetrics()
    # Without one given, no bound until a worker registers, and none registers with it.
    admission = admission or pooled(AdmissionSettings(), metrics)
    served = adapters.adapters if adapters is not None else Adapters()
    limit = worker_limit or WorkerContextLimit()
    intake = Intake(tokenizer, settings, limit, worker_features, served)
    endpoints = _Endpoints(settings, metrics, readiness, served)

    def completion(
        name: str, parse: Callable[[bytes], ParsedRequest], response_format: type[Format]
    ) -> _CompletionEndpoint:
        endpoint = Endpoint(name, gateway, metrics, response_format, settings.request_timeout_s)
        return _CompletionEndpoint(endpoint, intake, admission, parse, settings.max_body_bytes)

    document = openapi_document(settings, tokenizer.vocab_size)

    async def openapi(request: Request) -> Response:
        return Response(document, media_type=_JSON)

    completions = {
        "/v1/chat/completions": completion("chat_completions", parse_chat_request, ChatFormat),
        "/v1/completions": completion("completions", parse_completion_request, CompletionFormat),
    }
    routes = [
        # Reached only by a method other than POST (405) or a path under a root_path.
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in completions.items()),
        Route("/v1/models", endpoints.models),
        Route("/v1/models/{model:path}", endpoints.model),
        Route("/openapi.json", openapi),
        Route("/health", endpoints.health),
        Route("/metrics", endpoints.metrics),
    ]
    if adapters is not None:
        routes.append(Route("/v1/load_lora_adapter", adapters.load, methods=["POST"]))
        routes.append(Route("/v1/unload_lora_adapter", adapters.unload, methods=["POST"]))
    middleware = []
    gated: dict[str, ASGIApp] = dict(completions)
    if keys is not None:
        middleware.append(
            Middleware(
                AuthGate,
                book=keys,
                metrics_keyed=settings.metrics_auth,
                refused=metrics.auth_refused,
            )
        )
        gated = {
            path: AuthGate(endpoint, keys, settings.metrics_auth, metrics.auth_refused)
            for path, endpoint in completions.items()
        }
    return _Api(
        gated,
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled_error},
    )


class _Api(Starlette):
    """Starlette, with ``POST`` to a completion path sent to that path's app directly."""

    def __init__(self, completions: dict[str, ASGIApp], **starlette: Any) -> None:
        super().__init__(**starlette)
        self._completions = completions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            app = self._completions.get(scope["path"])
            if app is not None:
                await _answered(app, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


async def _answered(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """``app``, with an unexpected exception answered as Starlette's ServerErrorMiddleware
    answers it elsewhere: an OpenAI-style 500 if no response was started, and raised on for
    the server to log."""
    started = False

    async def sending(message: Message) -> None:
        nonlocal started
        started = True
        await send(message)

    try:
        await app(scope, receive, sending)
    except Exception:
        if not started:
            log_request(scope, 500)
            error = internal_error()
            await send_json(send, error.status, error.body(), JSON_HEADERS)
        raise


class _Endpoints:
    def __init__(
        self,
        settings: IngressApiSettings,
        metrics: IngressMetrics,
        readiness: Readiness | None,
        adapters: Adapters,
    ) -> None:
        created = int(time.time())
        self._served = [
            {"id": name, "object": "model", "created": created, "owned_by": "laneway"}
            for name in settings.served_model_names
        ]
        self._adapters = adapters
        # The list as last built, and the adapters' version it was built at.
        self._built: tuple[int, bytes, dict[str, bytes]] | None = None
        self._metrics = metrics
        # None: an app with no cluster behind it to speak of (tests of the API alone).
        self._readiness = readiness

    def _listing(self) -> tuple[bytes, dict[str, bytes]]:
        """``/v1/models`` and each model's object, built again only after adapters changed."""
        version = self._adapters.version
        if self._built is None or self._built[0] != version:
            entries = [*self._served, *self._adapters.model_entries()]
            by_name = {entry["id"]: orjson.dumps(entry) for entry in entries}
            listing = orjson.dumps({"object": "list", "data": entries})
            self._built = (version, listing, by_name)
        return self._built[1], self._built[2]

    async def models(self, request: Request) -> Response:
        return Response(self._listing()[0], media_type=_JSON)

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``)."""
        name = request.path_params["model"]
        listing, by_name = self._listing()
        if not name:  # /v1/models/: the list, as before this route took the slash
            return Response(listing, media_type=_JSON)
        body = by_name.get(name)
        if body is None:
            error = model_not_found(name[:MAX_MODEL_CHARS])
            log_request(request.scope, error.status)
            return _error_response(error)
        return Response(body, media_type=_JSON)

    async def health(self, request: Request) -> Response:
        if self._readiness is None:
            return Response(b'{"status":"ok"}', media_type=_JSON)
        status, body = self._readiness.answer()
        return Response(body, status_code=status, media_type=_JSON)

    async def metrics(self, request: Request) -> Response:
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)


@dataclass(frozen=True, slots=True)
class _CompletionEndpoint:
    """``POST /v1/chat/completions`` or ``POST /v1/completions``; ``parse`` reads its body."""

    endpoint: Endpoint
    intake: Intake
    admission: PooledAdmission
    parse: Callable[[bytes], ParsedRequest]
    max_body_bytes: int

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = time.perf_counter()
        headers = request_headers(scope)
        parsed: ParsedRequest | None = None
        exchange: Exchange | None = None
        try:
            parsed = self.parse(await read_json_body(headers, receive, self.max_body_bytes))
            session = session_id(headers.get(b"x-session-id"), parsed.params.user)
            spec = self.intake.spec(parsed, scope.get(TENANT), scope.get(CACHE_SALT))
            check_prompt_quota(scope, spec.prompt_length)
            # Last: a request the cluster could not take anyway is refused for that, not shed.
            # No higher than the key allows: a tenant cannot shed others by asking.
            asked = request_priority(headers.get(b"x-laneway-priority"), parsed.params.priority)
            priority = capped(scope, asked)
            tenant, weight = scope.get(TENANT), scope.get(TENANT_WEIGHT, 1.0)
            ticket = await self.admission.admit(priority, spec.model, tenant, weight)
        except ClientDisconnect:
            self._done(scope, CLIENT_CLOSED_STATUS, received, parsed)
            return
        except ApiError as error:
            self._done(scope, error.status, received, parsed)
            await send_json(send, error.status, error.body(), [*JSON_HEADERS, *error.headers])
            return
        try:
            routed = spec.model_copy(update={"priority": priority})
            exchange = Exchange(self.endpoint, parsed.params, routed, session, received)
            self._done(scope, await exchange.run(receive, send), received, parsed, exchange)
        finally:
            ticket.release()
            if exchange is not None:
                # Charged to the tenant's token quotas by the key check when the request leaves.
                scope[USED_TOKENS] = exchange.used_tokens()

    def _done(
        self,
        scope: Scope,
        status: int,
        received: float,
        parsed: ParsedRequest | None,
        exchange: Exchange | None = None,
    ) -> None:
        self.endpoint.metrics.request_done(self.endpoint.name, status)
        params = parsed.params if parsed is not None else None
        log_request(
            scope,
            status,
            time.perf_counter() - received,
            request_id=exchange.request_id if exchange is not None else None,
            model=params.model if params is not None else None,
            stream=params.stream if params is not None else None,
            usage=exchange.usage if exchange is not None else None,
            ttft_s=exchange.ttft_s if exchange is not None else None,
        )


def _error_response(error: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    return Response(error.body(), status_code=error.status, headers=headers, media_type=_JSON)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    log_request(request.scope, exc.status_code)
    # A 405 says which methods the path takes (Allow), as RFC 9110 has it.
    return _error_response(ApiError(exc.status_code, exc.detail), exc.headers)


async def _unhandled_error(request: Request, exc: Exception) -> Response:
    log_request(request.scope, 500)
    return _error_response(internal_error())
