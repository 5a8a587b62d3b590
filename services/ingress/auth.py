"""API keys at the door: every request but ``/health`` (and ``/metrics``, unless keyed) needs
``Authorization: Bearer KEY`` naming a live key, as the OpenAI SDK sends it; the key's tenant
is then held to its limits and written on the request (``scope[TENANT]``, then RequestSpec).
Loading and unloading LoRA adapters needs a key with the ``admin`` scope: an adapter's path is
read on every worker, and its name is served to every tenant.

The keys live in etcd (``bus.api_keys``); the ingress keeps all of them in memory, fed by an etcd
watch, so a request costs one SHA-256 and a dict look-up and a revocation takes effect as soon
as the watch delivers it (milliseconds).
"""

from __future__ import annotations

import asyncio
import functools

from prometheus_client import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from bus.api_keys import ApiKeyRecord, key_hash
from bus.api_keys import Scope as KeyScope
from schemas.events import utc_now
from services.ingress.access_log import log_request
from services.ingress.admission import PRIORITIES, Priority
from services.ingress.errors import ApiError
from services.ingress.limits import TenantLimits
from services.ingress.responses import JSON_HEADERS, Headers, send_json
from services.ingress.shared_limits import TenantGate

TENANT = "laneway.tenant"
"""The ASGI scope's entry for the tenant of an authenticated request."""
CACHE_SALT = "laneway.cache_salt"
"""The ASGI scope's entry for the salt of the key's cache group (``ApiKeyRecord.cache_salt``)."""
USED_TOKENS = "laneway.used_tokens"
"""The ASGI scope's entry for the prompt and completion tokens a request used (set as it ends),
charged to its tenant's token quotas."""
PROMPT_QUOTA = "laneway.prompt_quota"
"""The ASGI scope's entry for a check of the request's prompt against its tenant's token quotas
(``TenantGate.over_quota``): None if it fits, else the seconds to wait."""
TENANT_WEIGHT = "laneway.tenant_weight"
"""The ASGI scope's entry for the key's ``weight``: its tenant's share in admission."""
_MAX_PRIORITY = "laneway.max_priority"
# vLLM's paths for loading and unloading LoRA adapters (services.ingress.adapters).
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# A longer header is no key of ours; it is refused without hashing it.
_MAX_AUTHORIZATION = 256


class KeyBook:
    """The live keys by their hash, and the limits of each tenant: those of its newest key, so
    that a new key (a rotation) brings its limits in and revoking the old one keeps them."""

    def __init__(self, gate: TenantGate | None = None) -> None:
        self.gate = gate or TenantGate()
        self._loaded = asyncio.Event()
        self._by_hash: dict[str, ApiKeyRecord] = {}
        self._salts: dict[str, str] = {}
        self._weights: dict[str, float] = {}

    async def on_keys(self, records: list[ApiKeyRecord]) -> None:
        self._by_hash = {record.sha256: record for record in records}
        # An HMAC each: made once per key, not once per request.
        self._salts = {record.sha256: record.cache_salt() for record in records}
        newest = sorted(records, key=lambda record: record.created_at)
        self._weights = {r.tenant: r.weight for r in newest}
        self.gate.set_limits(
            {
                r.tenant: TenantLimits(
                    r.rate_per_s, r.max_concurrency, r.tokens_per_minute, r.tokens_per_day
                )
                for r in newest
            }
        )
        self._loaded.set()

    def weight(self, tenant: str) -> float:
        """The tenant's share in admission: its newest key's, as its limits are."""
        return self._weights.get(tenant, 1.0)

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    async def wait_loaded(self) -> None:
        await self._loaded.wait()

    def find(self, key: str) -> ApiKeyRecord | None:
        """The live key's record; None for one unknown, revoked or expired."""
        record = self._by_hash.get(key_hash(key))
        if record is None or record.expires_at is None:
            return record
        return None if record.expired(utc_now()) else record

    def cache_salt(self, record: ApiKeyRecord) -> str:
        salt = self._salts.get(record.sha256)
        return record.cache_salt() if salt is None else salt


class AuthGate:
    """ASGI middleware in front of the API's routes."""

    def __init__(self, app: ASGIApp, book: KeyBook, metrics_keyed: bool, refused: Counter) -> None:
        self._app = app
        self._book = book
        self._metrics_keyed = metrics_keyed
        self._refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/health":
            await self._app(scope, receive, send)
            return
        if path == "/metrics":
            if self._metrics_keyed:
                await self._keyed(scope, receive, send, "metrics")
            else:
                await self._app(scope, receive, send)
            return
        await self._keyed(scope, receive, send, "admin" if path in ADMIN_PATHS else "inference")

    async def _keyed(self, scope: Scope, receive: Receive, send: Send, needs: KeyScope) -> None:
        record = self._record(scope)
        if isinstance(record, ApiError):
            extra = [(b"www-authenticate", b"Bearer")] if record.status == 401 else []
            await self._refuse(scope, send, record, "", extra)
            return
        if needs not in record.scopes:
            error = ApiError(
                403,
                f"This API key lacks the '{needs}' scope needed for {scope['path']}.",
                code="insufficient_scope",
                type="invalid_request_error",
            )
            await self._refuse(scope, send, error, record.tenant)
            return
        if needs != "inference":  # the tenant's limits are on its inference
            await self._app(scope, receive, send)
            return
        gate = self._book.gate
        wait_s = await gate.enter(record.tenant)
        if wait_s is not None:
            await self._refuse(
                scope, send, _limited(record.tenant), record.tenant, retry_after=wait_s
            )
            return
        scope[TENANT] = record.tenant
        scope[CACHE_SALT] = self._book.cache_salt(record)
        scope[_MAX_PRIORITY] = record.max_priority
        scope[TENANT_WEIGHT] = self._book.weight(record.tenant)
        scope[PROMPT_QUOTA] = functools.partial(gate.over_quota, record.tenant)
        try:
            await self._app(scope, receive, send)
        finally:
            gate.leave(record.tenant, scope.get(USED_TOKENS, 0))

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        error: ApiError,
        tenant: str,
        extra: Headers | None = None,
        retry_after: int | None = None,
    ) -> None:
        headers = [*JSON_HEADERS, *(extra or [])]
        if error.status == 503:
            retry_after = 1
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        self._refused.labels(error.code or "", tenant).inc()
        log_request(scope, error.status)
        await send_json(send, error.status, error.body(), headers)

    def _record(self, scope: Scope) -> ApiKeyRecord | ApiError:
        if not self._book.loaded:
            return ApiError(
                503, "The API keys are still loading; retry in a moment.", code="keys_loading"
            )
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            return ApiError(
                401,
                "You didn't provide an API key. Provide it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
                type="invalid_request_error",
            )
        scheme, _, key = header.partition(b" ")
        record = None
        if len(header) <= _MAX_AUTHORIZATION and scheme.lower() == b"bearer":
            record = self._book.find(key.strip().decode("latin-1"))
        if record is None:
            return ApiError(
                401,
                "Incorrect API key provided, or the key was revoked or expired.",
                code="invalid_api_key",
                type="invalid_request_error",
            )
        return record


def capped(scope: Scope, priority: Priority) -> Priority:
    """A request's priority, no higher than its key's ``max_priority`` (where keys are taken)."""
    highest = scope.get(_MAX_PRIORITY)
    if highest is None:
        return priority
    return max(priority, highest, key=PRIORITIES.index)  # later in PRIORITIES: lower


def check_prompt_quota(scope: Scope, prompt_tokens: int) -> None:
    """Raise the tenant's 429 if the request's prompt would pass its token quotas."""
    check = scope.get(PROMPT_QUOTA)
    wait_s = None if check is None else check(prompt_tokens)
    if wait_s is not None:
        error = _limited(scope.get(TENANT, ""))
        error.headers.append((b"retry-after", str(wait_s).encode()))
        raise error


def _limited(tenant: str) -> ApiError:
    return ApiError(
        429,
        f"Tenant '{tenant}' is over its request rate, concurrency or token limit; retry later.",
        code="rate_limit_exceeded",
        type="rate_limit_error",
    )
