"""API keys on a real cluster (etcd, NATS and every service as its own process): keys made,
listed and revoked with `laneway keys`, used by the unmodified OpenAI SDK; no key or a revoked
one is refused, a revocation within a second, an expired one too; a tenant past its concurrency
limit gets 429."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aetcd
import httpx
import openai
import pytest

from bus.api_keys import create_key, list_keys
from bus.credentials import ETCD_CREDS_ENV, Credentials
from bus.registry import EtcdCluster, etcd_endpoints
from infra.cluster import LocalCluster
from tests.live import ClusterFactory
from tests.security.keys_cli import create, keys

MODEL = "laneway-sim"


def client(cluster: LocalCluster, key: str) -> openai.OpenAI:
    # No retries: a 429 or 401 is what the test looks at.
    return openai.OpenAI(base_url=cluster.config.base_url, api_key=key, max_retries=0)


def ask(sdk: openai.OpenAI) -> str:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=1)


def test_startup_key_serves_and_no_key_is_refused(cluster: LocalCluster) -> None:
    assert cluster.api_key is not None and cluster.api_key.startswith("lw-")
    assert ask(client(cluster, cluster.api_key))
    refused = httpx.post(
        cluster.config.base_url + "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.AuthenticationError):
        ask(client(cluster, "lw-made-up"))
    # The readiness probe stays open.
    assert httpx.get(cluster.config.base_url.removesuffix("/v1") + "/health").status_code in (
        200,
        503,
    )


def taken_within_a_second(sdk: openai.OpenAI) -> str:
    """The answer to a key just made: the ingress learns of it through its etcd watch, which a
    loaded machine delivers in tens of milliseconds, as it does a revocation."""
    since = time.monotonic()
    while True:
        try:
            return ask(sdk)
        except openai.AuthenticationError:
            assert time.monotonic() - since < 1.0, "the new key was still refused after 1 s"
            time.sleep(0.02)


def test_created_key_works_then_is_refused_within_a_second_of_revocation(
    cluster: LocalCluster,
) -> None:
    key = create(cluster, "--tenant", "acme")
    assert key.startswith("lw-")
    sdk = client(cluster, key)
    assert taken_within_a_second(sdk)
    listed = keys(cluster, "list", "--json", "--etcd-endpoints", cluster.etcd_endpoints)
    records = json.loads(listed.stdout)
    (acme,) = [r for r in records if r["tenant"] == "acme"]
    assert "sha256" not in acme and key not in listed.stdout
    assert "cache_secret" not in acme and acme["cache_group"] is None
    revoked = keys(cluster, "revoke", acme["key_id"], "--etcd-endpoints", cluster.etcd_endpoints)
    assert revoked.returncode == 0, revoked.stderr
    since = time.monotonic()
    while True:
        try:
            sdk.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - since < 1.0, "the revoked key was still taken after 1 s"
        time.sleep(0.02)
    with pytest.raises(openai.AuthenticationError):
        ask(sdk)
    again = keys(cluster, "revoke", acme["key_id"], "--etcd-endpoints", cluster.etcd_endpoints)
    assert again.returncode == 2 and "no key" in again.stderr


def test_a_key_made_to_expire_is_refused_once_it_has(cluster: LocalCluster) -> None:
    key = create(cluster, "--tenant", "brief", "--expires-in", "4")
    sdk = client(cluster, key)
    assert ask(sdk)  # a `laneway keys` run takes a second or two here, the key four
    listed = keys(cluster, "list", "--json", "--etcd-endpoints", cluster.etcd_endpoints)
    (brief,) = [r for r in json.loads(listed.stdout) if r["tenant"] == "brief"]
    created, expires = (datetime.fromisoformat(brief[f]) for f in ("created_at", "expires_at"))
    assert expires - created == timedelta(seconds=4)
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.05)
    with pytest.raises(openai.AuthenticationError) as refused:
        ask(sdk)
    assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
    table = keys(cluster, "list", "--etcd-endpoints", cluster.etcd_endpoints).stdout
    assert next(line for line in table.splitlines() if " brief " in line).endswith("(expired)")


def test_tenant_over_its_concurrency_limit_gets_429(cluster: LocalCluster) -> None:
    key = create(cluster, "--tenant", "small", "--max-concurrency", "1")
    sdk = client(cluster, key)
    # A long answer holds the tenant's one slot while the second request comes.
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as refused:
            ask(sdk)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        # Another tenant is not held back by this one.
        assert ask(client(cluster, create(cluster, "--tenant", "other")))
    finally:
        stream.close()
    # The slot comes back once the stream ends.
    deadline = time.monotonic() + 10
    while True:
        try:
            assert ask(sdk)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_bad_arguments_are_refused_in_one_line(cluster: LocalCluster) -> None:
    at = ("--etcd-endpoints", cluster.etcd_endpoints)
    for args in (
        ("create", "--tenant", "no spaces", *at),
        ("create", "--tenant", "t", "--rate", "0", *at),
        ("revoke", "../workers/x", *at),
    ):
        done = keys(cluster, *args)
        assert done.returncode == 2, done
        assert done.stderr.startswith("laneway keys: ") and done.stderr.count("\n") == 1


async def test_only_the_admin_writes_keys_and_the_ingress_alone_reads_them(
    cluster: LocalCluster,
) -> None:
    """etcd auth as `laneway up` sets it: a service's own credentials cannot mint a key, and
    no other service's than the ingress's can read the hashes."""

    def as_service(name: str) -> EtcdCluster:
        creds = Credentials.read(Path(cluster.service(name).env[ETCD_CREDS_ENV]))
        endpoints = etcd_endpoints(cluster.etcd_endpoints)
        return EtcdCluster(endpoints, failover_s=0.0, credentials=creds)

    for name in ("ingress", "planner", "kv-indexer", "decode-worker-0"):
        etcd = as_service(name)
        try:
            with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                await create_key(etcd, f"minted-by-{name}")
            if name == "ingress":
                assert {r.tenant for r in await list_keys(etcd)} >= {"local"}
            else:
                with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                    await list_keys(etcd)
        finally:
            await etcd.close()
