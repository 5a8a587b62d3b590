"""Tenants' prefix caches kept apart on a real cluster (etcd, NATS, every service its own process,
the sim engine): a tenant probing another tenant's prompt through ``cached_tokens`` learns
nothing its own history does not explain; the same tenant (any of its keys) still hits, and so
do keys made with ``--cache-group`` into another tenant's group; session ids bind per tenant.

Prompts are ASCII on the sim's byte tokenizer (a token a byte) and the cluster has one worker,
so every request meets the same prefix cache and the counts are exact, in 16-token blocks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bus.registry import connect_etcd
from bus.sessions import SESSIONS_PREFIX
from infra.cluster import LocalCluster
from tests.live import ClusterFactory
from tests.security.keys_cli import create

MODEL = "laneway-sim"
BLOCK = 16
# 64 tokens (4 blocks) before the secret, the secret's block, then 320 more: 25 blocks.
_HEAD = "Support notes: customer 7731, verified by phone today. Account".ljust(64)
_TAIL = (" Remember to confirm the address before any change of the plan." * 6)[:320]


def secret_prompt(pin: str, head: str = _HEAD) -> str:
    prompt = head + f" PIN: {pin}.".ljust(BLOCK) + _TAIL
    assert len(prompt) == 25 * BLOCK
    return prompt


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=1)


def cached(
    cluster: LocalCluster,
    key: str,
    prompt: str,
    session: str | None = None,
    cache_salt: str | None = None,
) -> int:
    """The prompt tokens the answer says were cached."""
    body: dict[str, object] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers["x-session-id"] = session
    reply = httpx.post(
        cluster.config.base_url + "/completions", json=body, headers=headers, timeout=30
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_another_tenant_cannot_probe_a_prompt_through_cached_tokens(
    cluster: LocalCluster,
) -> None:
    victim = create(cluster, "--tenant", "victim")
    prober = create(cluster, "--tenant", "prober")
    cached(cluster, victim, secret_prompt("4812"))
    first = cached(cluster, prober, secret_prompt("0000"))
    wrong = cached(cluster, prober, secret_prompt("1111"))
    right = cached(cluster, prober, secret_prompt("4812"))
    # The right guess reads what a wrong one reads (on a shared cache: the victim's whole
    # prompt), which its own first probe explains (the head they share), and nothing more.
    assert right == wrong
    assert wrong == len(_HEAD)
    # Before it sent anything, the prober had nothing cached: not even the victim's head.
    assert first == 0


def test_the_same_tenant_hits_with_any_of_its_keys(cluster: LocalCluster) -> None:
    first_key = create(cluster, "--tenant", "rotating")
    second_key = create(cluster, "--tenant", "rotating")
    # A head of its own: no other test's prompt shares its first block.
    prompt = secret_prompt("2468", "Rotation test: a tenant with two keys.".ljust(len(_HEAD)))
    assert cached(cluster, first_key, prompt) == 0
    assert cached(cluster, first_key, prompt) == len(prompt) - BLOCK
    # A rotation keeps the cache: the tenant's second key reads the first key's blocks.
    assert cached(cluster, second_key, prompt) == len(prompt) - BLOCK


def test_a_cache_group_shares_and_a_client_salt_only_narrows(cluster: LocalCluster) -> None:
    owner = create(cluster, "--tenant", "group-owner")
    # A tenant of its own that the operator lets share group-owner's cache.
    partner = create(cluster, "--tenant", "partner", "--cache-group", "group-owner")
    outsider = create(cluster, "--tenant", "outsider")
    prompt = secret_prompt("1357")
    assert cached(cluster, owner, prompt) == 0
    assert cached(cluster, partner, prompt) == len(prompt) - BLOCK
    assert cached(cluster, outsider, prompt) == 0
    # A client's cache_salt narrows sharing within its tenant (nothing cached under it yet)...
    assert cached(cluster, owner, prompt, cache_salt="private") == 0
    assert cached(cluster, owner, prompt, cache_salt="private") == len(prompt) - BLOCK
    # ...and never widens it: the same salt from another tenant meets none of those blocks.
    assert cached(cluster, outsider, prompt, cache_salt="private") == 0


def test_session_ids_bind_per_tenant(cluster: LocalCluster) -> None:
    """Two tenants using the same session id get a binding each: neither is told it owns the
    other's conversation."""
    tenants = {name: create(cluster, "--tenant", name) for name in ("sess-a", "sess-b")}
    for name, key in tenants.items():
        cached(cluster, key, f"{name} says hello to the support bot", session="conv-1")

    async def bindings() -> list[str]:
        etcd = connect_etcd(cluster.etcd_endpoints)
        try:
            found = await etcd.get_prefix(SESSIONS_PREFIX)
            return [kv.key.removeprefix(SESSIONS_PREFIX).decode() for kv in found]
        finally:
            await etcd.close()

    conv = [key for key in asyncio.run(bindings()) if key.endswith("conv-1")]
    assert len(conv) == 2, conv
    for name in tenants:
        assert sum(name in key for key in conv) == 1, conv
