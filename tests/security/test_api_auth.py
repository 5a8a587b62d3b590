"""The API's key check (services.ingress.auth) in front of an app on a fake gateway: which paths
need a key, the OpenAI-shaped refusals, the tenant on the request, a revocation seen at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, get_args

import httpx
import pytest

from bus.api_keys import ApiKeyRecord, KeyPriority, Scope, key_hash
from schemas.events import utc_now
from services.common.tokenizer import ByteTokenizer
from services.ingress.admission import PRIORITIES
from services.ingress.api import create_app
from services.ingress.auth import KeyBook, capped
from services.ingress.settings import IngressApiSettings
from tests.ingress.fakes import FakeGateway
from tests.ingress.helpers import chat_body

KEY = "lw-good-key-of-acme"
METRICS_KEY = "lw-key-of-the-scraper"


def record(key: str, tenant: str, *scopes: Scope, **limits: Any) -> ApiKeyRecord:
    return ApiKeyRecord(
        key_id=key_hash(key)[:16],
        tenant=tenant,
        sha256=key_hash(key),
        scopes=scopes or ("inference",),
        **limits,
    )


@asynccontextmanager
async def api(
    *records: ApiKeyRecord, loaded: bool = True, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeGateway, KeyBook]]:
    book = KeyBook()
    if loaded:
        await book.on_keys(list(records))
    gateway = FakeGateway()
    app = create_app(
        gateway,
        ByteTokenizer(),
        IngressApiSettings(instance_id="ingress-1", **settings),
        keys=book,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        yield client, gateway, book


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        (bearer("lw-not-a-key"), "invalid_api_key"),
        ({"Authorization": f"Basic {KEY}"}, "invalid_api_key"),
        (bearer(KEY + "x" * 300), "invalid_api_key"),
    ],
)
async def test_no_or_wrong_key_is_401_in_openai_shape(headers: dict[str, str], code: str) -> None:
    async with api(record(KEY, "acme")) as (client, gateway, _):
        for reply in (
            await client.get("/v1/models", headers=headers),
            await client.post("/v1/chat/completions", json=chat_body(), headers=headers),
        ):
            assert reply.status_code == 401
            assert reply.headers["www-authenticate"] == "Bearer"
            error = reply.json()["error"]
            assert error["code"] == code
            assert error["type"] == "invalid_request_error"
            assert set(error) == {"message", "type", "param", "code"}
        assert gateway.submitted == []
        scraped = (await client.get("/metrics")).text
    assert f'laneway_ingress_auth_refused_total{{code="{code}",tenant=""}} 2.0' in scraped


async def test_valid_key_is_served_and_its_tenant_is_on_the_request() -> None:
    async with api(record(KEY, "acme")) as (client, gateway, _):
        reply = await client.post("/v1/chat/completions", json=chat_body(), headers=bearer(KEY))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "Hello"
        assert [s.spec.tenant for s in gateway.submitted] == ["acme"]


async def test_api_without_keys_leaves_tenant_unset() -> None:
    gateway = FakeGateway()
    app = create_app(gateway, ByteTokenizer(), IngressApiSettings(instance_id="ingress-1"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        reply = await client.post("/v1/chat/completions", json=chat_body())
    assert reply.status_code == 200
    assert gateway.submitted[0].spec.tenant is None


async def test_revoked_key_is_refused_at_the_next_request() -> None:
    async with api(record(KEY, "acme")) as (client, _, book):
        assert (await client.get("/v1/models", headers=bearer(KEY))).status_code == 200
        await book.on_keys([])
        reply = await client.get("/v1/models", headers=bearer(KEY))
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"


async def test_a_key_is_taken_until_it_expires() -> None:
    soon = record(KEY, "acme", expires_at=utc_now() + timedelta(seconds=0.3))
    gone = record(METRICS_KEY, "ops", expires_at=utc_now() - timedelta(seconds=1))
    async with api(soon, gone) as (client, _, _):
        assert (await client.get("/v1/models", headers=bearer(METRICS_KEY))).status_code == 401
        assert (await client.get("/v1/models", headers=bearer(KEY))).status_code == 200
        await asyncio.sleep(0.35)
        reply = await client.get("/v1/models", headers=bearer(KEY))
        assert reply.status_code == 401
        assert reply.json()["error"]["code"] == "invalid_api_key"


async def test_health_is_open_and_metrics_open_unless_keyed() -> None:
    async with api(record(KEY, "acme")) as (client, _, _):
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
    keys = (record(KEY, "acme"), record(METRICS_KEY, "ops", "metrics"))
    async with api(*keys, metrics_auth=True) as (client, _, _):
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 401
        refused = await client.get("/metrics", headers=bearer(KEY))
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "insufficient_scope"
        assert (await client.get("/metrics", headers=bearer(METRICS_KEY))).status_code == 200
        # A scraper's key is no key for completions.
        reply = await client.post("/v1/completions", json={}, headers=bearer(METRICS_KEY))
        assert reply.status_code == 403


async def test_keys_not_loaded_yet_is_503_with_retry_after() -> None:
    async with api(loaded=False) as (client, _, _):
        reply = await client.get("/v1/models", headers=bearer(KEY))
        assert reply.status_code == 503
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "keys_loading"
        assert (await client.get("/health")).status_code == 200


async def test_tenant_over_its_rate_gets_429_with_retry_after() -> None:
    async with api(record(KEY, "acme", rate_per_s=0.2)) as (client, _, book):
        assert (await client.get("/v1/models", headers=bearer(KEY))).status_code == 200
        reply = await client.get("/v1/models", headers=bearer(KEY))
        assert reply.status_code == 429
        assert 1 <= int(reply.headers["retry-after"]) <= 6  # 5 s, and the tenth it came in
        assert reply.json()["error"]["code"] == "rate_limit_exceeded"
        assert book.gate.in_flight("acme") == 0
        scraped = (await client.get("/metrics")).text
    refused = 'laneway_ingress_auth_refused_total{code="rate_limit_exceeded",tenant="acme"} 1.0'
    assert refused in scraped


async def test_concurrency_slot_is_given_back_when_a_request_ends() -> None:
    async with api(record(KEY, "acme", max_concurrency=1)) as (client, _, book):
        for _ in range(3):
            reply = await client.post(
                "/v1/chat/completions", json=chat_body(stream=True), headers=bearer(KEY)
            )
            assert reply.status_code == 200
        assert book.gate.in_flight("acme") == 0


async def test_a_prompt_that_would_pass_the_token_quota_is_429_and_charges_nothing() -> None:
    async with api(record(KEY, "acme", tokens_per_minute=200)) as (client, _, book):
        body = chat_body(messages=[{"role": "user", "content": "far too long " * 20}])
        reply = await client.post("/v1/chat/completions", json=body, headers=bearer(KEY))
        assert reply.status_code == 429
        assert reply.json()["error"]["code"] == "rate_limit_exceeded"
        assert reply.headers["retry-after"] == "60"  # it never fits: wait the minute out
        assert book.gate.in_flight("acme") == 0
        # A short one fits, and is charged what it used.
        reply = await client.post("/v1/chat/completions", json=chat_body(), headers=bearer(KEY))
        assert reply.status_code == 200
        used = reply.json()["usage"]["total_tokens"]
        assert 0 < used < 200
        assert book.gate.over_quota("acme", 200 - used) is None
        assert book.gate.over_quota("acme", 201 - used) is not None


async def test_tenant_limits_are_those_of_its_newest_key() -> None:
    old = record(KEY, "acme", max_concurrency=1, weight=2.0)
    new = record("lw-rotated", "acme", max_concurrency=5, weight=3.0)
    async with api(new, old) as (_, _, book):
        assert book.weight("acme") == 3.0 and book.weight("other") == 1.0
        for _ in range(5):
            assert await book.gate.enter("acme") is None
        assert await book.gate.enter("acme") == 1


async def test_requests_get_no_higher_priority_than_their_key_allows() -> None:
    assert get_args(KeyPriority) == PRIORITIES
    async with api(record(KEY, "batch", max_priority="low")) as (client, _, _):
        for asked in ("high", "normal", "low"):
            reply = await client.post(
                "/v1/chat/completions",
                json=chat_body(),
                headers={**bearer(KEY), "x-laneway-priority": asked},
            )
            assert reply.status_code == 200
        scraped = (await client.get("/metrics")).text
    assert 'laneway_ingress_admitted_total{priority="low"} 3.0' in scraped
    assert 'priority="high"} 1' not in scraped
    # A key allowed high keeps what a request asks below it.
    request = {"type": "http", "path": "/", "laneway.max_priority": "high"}
    assert [capped(request, p) for p in PRIORITIES] == list(PRIORITIES)
    assert capped({"type": "http"}, "high") == "high"
