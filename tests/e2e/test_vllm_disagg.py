"""Disaggregated serving with vLLM on both sides: a prefill worker and a decode worker, each
running vLLM's engine (its CPU build) over `laneway make-tiny-model`'s checkpoint, with
``--disagg always``. Every prompt is computed on the prefill worker, its KV leaves vLLM's cache
there, crosses the bus, and enters the decode worker's vLLM through Laneway's KV connector.

- Greedy answers to token-id prompts are vLLM's own (``LLM.generate`` on the same ids, computed
  in a process of its own while the cluster loads).
- Every request was prefilled remotely and its KV taken; the decode worker computed only what
  did not come over (each prompt's partial last block and the first token), by its engine's own
  count of prompt tokens computed."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infra.cluster import LocalCluster
from schemas.events import KvTransferred, PrefillCompleted, RequestFinished, RouteDecided
from services.common.hf_tokenizer import HfTokenizer
from tests.e2e.vllm_cluster import vllm_env
from tests.e2e.vllm_reference import Reference
from tests.helpers import eventually
from tests.live import ClusterFactory, metric, observe, registrations

pytestmark = pytest.mark.xdist_group("vllm-e2e")

BLOCK = 32
# Token-id prompts inside the tiny model's vocabulary (2,048; the first three are its special
# tokens), seeded: shorter than a block, exactly three blocks, and partial last blocks.
_RNG = random.Random(3707)
PROMPTS = [[_RNG.randrange(3, 2000) for _ in range(n)] for n in (20, 3 * BLOCK, 45, 130, 161, 77)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """vLLM's greedy answers, computed while the cluster starts."""
    with Reference(vllm_model, PROMPTS, MAX_TOKENS, tmp_path_factory.mktemp("vllm-ref")) as ref:
        yield ref


@pytest.fixture(scope="module")
def cluster(
    cluster_factory: ClusterFactory, vllm_model: Path, reference: Reference
) -> LocalCluster:
    env = {
        **vllm_env(vllm_model),
        "LANEWAY_DISAGG": "always",
        # A hand-off slower than this would be prefilled again on the decode worker, and the
        # test would say so; on two loaded cores a first prefill can take seconds.
        "LANEWAY_HANDOFF_TIMEOUT_S": "60",
    }
    return cluster_factory(workers=1, prefill_workers=1, env=env, start_timeout=300)


async def test_a_vllm_prefill_workers_kv_continues_on_a_vllm_decode_worker(
    cluster: LocalCluster, vllm_model: Path, reference: Reference
) -> None:
    workers = await registrations(cluster.etcd_endpoints)
    # Both can send and take a prompt's KV, and report their caches, at vLLM's block size.
    assert {
        (r.role, r.engine, r.kv_handoff, r.kv_events, r.block_size) for r in workers.values()
    } == {("prefill", "vllm", True, True, BLOCK), ("decode", "vllm", True, True, BLOCK)}
    [prefill_id] = [w for w, r in workers.items() if r.role == "prefill"]
    decode = cluster.service("decode-worker-0")
    computed = {"kind": "prefill"}
    taken = {"side": "received", "outcome": "ok"}
    before = await metric(decode, "laneway_worker_tokens_total", computed)
    bus, seen = await observe(cluster.nats_url)

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> dict[str, object]:
        body = {
            "model": cluster.config.env["LANEWAY_MODEL"],
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        reply: dict[str, object] = (
            (await http.post("/completions", json=body)).raise_for_status().json()
        )
        return reply

    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=180
    ) as http:
        replies = await asyncio.gather(*(one(http, p) for p in PROMPTS))
    tokenizer = HfTokenizer(vllm_model)
    expected = [tokenizer.decode(ids) for ids in reference.answers()]
    assert [r["choices"][0]["text"] for r in replies] == expected  # type: ignore[index]

    ids = [str(r["id"]).removeprefix("cmpl-") for r in replies]
    await eventually(lambda: all(seen.of(RequestFinished, i) for i in ids), timeout=10)
    for request_id in ids:
        # The route, to the decode worker and its copy to the prefill worker.
        routes = seen.of(RouteDecided, request_id)
        [handoff] = seen.of(PrefillCompleted, request_id)
        [moved] = seen.of(KvTransferred, request_id)
        [finished] = seen.of(RequestFinished, request_id)
        assert len(routes) == 2
        for route in routes:
            assert isinstance(route, RouteDecided) and route.prefill is not None
            assert route.prefill.prefill_worker_id == prefill_id
        assert isinstance(handoff, PrefillCompleted) and handoff.error is None
        assert handoff.payload is not None and handoff.payload.size > 0
        assert isinstance(moved, KvTransferred) and moved.from_worker_id == prefill_id
        assert isinstance(finished, RequestFinished)
        assert finished.prefill_worker_id == prefill_id
    await bus.close()
    assert await metric(decode, "laneway_worker_handoffs_total", taken) == len(PROMPTS)
    # vLLM on the decode worker found each prompt's full blocks loaded and computed the rest: the
    # partial last block and the first token (the prompt it continues ends with it).
    recomputed = sum(len(p) % BLOCK + 1 for p in PROMPTS)
    after = await metric(decode, "laneway_worker_tokens_total", computed)
    assert after - before == recomputed < sum(len(p) + 1 for p in PROMPTS)
