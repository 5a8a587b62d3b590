"""Client strings that reach events, subjects or etcd keys are bounded at the door: a 900 KB
session id once took etcd past its request limit, and a hundred of them grew it to 64 MB."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from bus.registry import connect_etcd
from bus.sessions import SESSIONS_PREFIX, session_key
from infra.keys import STARTUP_TENANT
from services.ingress.openai_models import MAX_MODEL_CHARS, MAX_SESSION_ID_CHARS, MAX_STOP_CHARS
from tests.ingress.helpers import chat_body, completion_body, harness
from tests.live import ClusterFactory

TOO_LONG = [
    (chat_body(user="u" * (MAX_SESSION_ID_CHARS + 1)), {}, "user", MAX_SESSION_ID_CHARS),
    (
        chat_body(),
        {"x-session-id": "s" * (MAX_SESSION_ID_CHARS + 1)},
        "x-session-id",
        MAX_SESSION_ID_CHARS,
    ),
    (completion_body(stop="x" * (MAX_STOP_CHARS + 1)), {}, "stop", MAX_STOP_CHARS),
    (completion_body(model="m" * (MAX_MODEL_CHARS + 1)), {}, "model", MAX_MODEL_CHARS),
    (completion_body(stop=["\n", "x" * (MAX_STOP_CHARS + 1)]), {}, "stop[1]", MAX_STOP_CHARS),
]


@pytest.mark.parametrize(("body", "headers", "param", "limit"), TOO_LONG)
async def test_an_over_long_field_is_a_400_naming_it(
    body: dict[str, Any], headers: dict[str, str], param: str, limit: int
) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with harness() as h:
        response = await h.client.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        param,
        "string_above_max_length",
    )
    assert f"maximum length {limit}," in error["message"]
    assert h.gateway.submitted == []


async def test_fields_at_their_limits_are_taken() -> None:
    at_limit = "u" * MAX_SESSION_ID_CHARS
    async with harness() as h:
        body = chat_body(user=at_limit, stop=["y" * MAX_STOP_CHARS])
        assert (await h.client.post("/v1/chat/completions", json=body)).status_code == 200
    assert h.gateway.submitted[0].session_id == at_limit


async def test_an_oversized_session_id_never_reaches_etcd(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=1, policy="kv")
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30
    ) as client:
        ok = await client.post("/chat/completions", json=chat_body(user="fits"))
        assert ok.status_code == 200, ok.text
        # 100 KB etcd would have stored; 900 KB it would have refused.
        for size in (100_000, 900_000):
            refused = await client.post("/chat/completions", json=chat_body(user="s" * size))
            assert refused.status_code == 400, refused.text[:300]
            assert refused.json()["error"]["param"] == "user"
    etcd = connect_etcd(cluster.etcd_endpoints)
    try:
        keys = [kv.key for kv in await etcd.get_prefix(SESSIONS_PREFIX, keys_only=True)]
    finally:
        await etcd.close()
    # The session within the tenant of the key the cluster's clients send.
    assert keys == [SESSIONS_PREFIX + session_key(STARTUP_TENANT, "fits").encode()]


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("max_tokens", 3.0, 200),
        ("max_tokens", 3.5, 400),
        ("seed", 2.0**60, 400),
        ("seed", 7.0, 200),
    ],
)
async def test_an_integral_double_is_an_integer_while_exact(
    field: str, value: float, status: int
) -> None:
    async with harness() as h:
        response = await h.client.post("/v1/completions", json=completion_body(**{field: value}))
    assert response.status_code == status, response.text
