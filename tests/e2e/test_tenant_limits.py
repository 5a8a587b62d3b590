"""A tenant's limits hold for the whole cluster behind two ingress replicas (`laneway up
--ingresses 2`, API keys on): its concurrency, whichever replica each connection reaches, and its
token quota, with OpenAI's 429 and a ``Retry-After``."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.live import ClusterFactory
from tests.security.keys_cli import create

MODEL = "laneway-sim"
TWO_SLOTS = {"LANEWAY_MAX_NUM_SEQS": "2"}


async def _opened(
    http: httpx.AsyncClient, key: str, i: int, hold: asyncio.Event
) -> tuple[int, str]:
    """A long stream on a connection of its own (the pool opens one per stream in flight); its
    status and error code, the stream held open until every other has its answer. The stream
    outlasts the hold by far (4,000 tokens, and the client reads none of them meanwhile, so the
    server soon waits on the socket): a served one is in flight until the hold ends, and no slot
    is given back for a later request to take."""
    body = {"model": MODEL, "prompt": f"long request {i} " * 4, "max_tokens": 4000, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with http.stream("POST", "/completions", json=body, headers=headers) as reply:
        code = ""
        if reply.status_code != 200:
            code = json.loads(await reply.aread())["error"]["code"]
        await hold.wait()
        return reply.status_code, code


def test_a_tenants_concurrency_holds_across_ingress_replicas(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, ingresses=2, env=TWO_SLOTS)
    key = create(cluster, "--tenant", "acme", "--max-concurrency", "4")

    async def burst() -> list[tuple[int, str]]:
        hold = asyncio.Event()
        # One client made beforehand: the requests go out together, not one client's TLS
        # set-up apart each.
        async with httpx.AsyncClient(base_url=cluster.config.base_url, timeout=60) as http:
            tasks = [asyncio.create_task(_opened(http, key, i, hold)) for i in range(24)]
            # Every answer is in (a 429 at once, a 200 at its first token) before any ends.
            await asyncio.sleep(3)
            hold.set()
            return await asyncio.gather(*tasks)

    answers = asyncio.run(burst())
    served = [a for a in answers if a[0] == 200]
    assert 1 <= len(served) <= 4, answers
    assert all(a == (429, "rate_limit_exceeded") for a in answers if a[0] != 200), answers
    # Held across the replicas all along (the API port's /metrics, open unless keyed).
    metrics = httpx.get(cluster.config.base_url.removesuffix("/v1") + "/metrics").text
    assert "laneway_ingress_tenant_limits_shared 1.0" in metrics


def test_a_token_quota_holds_across_ingress_replicas(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2, ingresses=2)
    key = create(cluster, "--tenant", "acme", "--tokens-per-minute", "400")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "count my tokens " * 4, "max_tokens": 24}
    used, refused = 0, None
    for _ in range(40):
        # A connection each: the kernel spreads them over both replicas.
        with httpx.Client(base_url=cluster.config.base_url, timeout=30) as http:
            reply = http.post("/completions", json=body, headers=headers)
        if reply.status_code == 429:
            refused = reply
            break
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        used += usage["prompt_tokens"] + usage["completion_tokens"]
    assert refused is not None, f"{used} tokens used and never refused"
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
    assert 1 <= int(refused.headers["retry-after"]) <= 61
    # Refused once its prompt (64 tokens) would pass the quota, or once spent. A charge is
    # written as its request ends: the next may start before the other replica has read it,
    # so the quota is passed by one request (88 tokens) at most.
    assert 400 - 64 < used <= 400 + 88, used
