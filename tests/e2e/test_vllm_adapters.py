"""LoRA adapters on a vLLM worker (its CPU build), loaded through the API: tiny adapters for the
tiny checkpoint (`laneway make-tiny-lora`), two held at once (`--max-loras 2`) by one worker.

The checkpoint is the decisive one (tests/decisive_model.py): no adapter can tip its greedy
tokens, so what tells the runs apart is the log probability of each position's runner-up,
which every layer, the adapter's included, moves. Each run's runner-ups are its signature:
- every adapter changes the base model's, and each other's;
- run side by side in one batch (base and three adapters, more than the worker holds) each
  request keeps the signature it has alone: a base request beside adapters runs no adapter
  (vLLM's CPU kernels gave it the last slot's, services/engine/vllm_engine/lora_rows.py), and
  an adapter evicted and loaded again is the same adapter;
- an adapter whose files are missing fails its own requests with the reason, and the worker
  serves on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import WorkerLoadReported
from services.engine.torch_engine.tiny_lora import make_tiny_lora
from tests.e2e.vllm_cluster import api, served_model, vllm_env
from tests.helpers import eventually
from tests.live import ClusterFactory, observe

pytestmark = pytest.mark.xdist_group("vllm-e2e")

ADAPTERS = ("ad-a", "ad-b", "ad-c")
PROMPT = [5 + (i * 37) % 1900 for i in range(48)]
TOKENS = 12


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory, vllm_model: Path) -> LocalCluster:
    env = {**vllm_env(vllm_model), "LANEWAY_MAX_LORAS": "2"}
    return cluster_factory(workers=1, env=env, start_timeout=240)


@pytest.fixture(scope="module")
def adapter_dirs(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(ADAPTERS, start=1):
        make_tiny_lora(folder / name, vllm_model, seed=seed)
    return {name: folder / name for name in ADAPTERS}


async def signature(http: httpx.AsyncClient, model: str) -> list[float]:
    """The runner-up's log probability at each position of a greedy answer to ``PROMPT``."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    reply = await http.post("/completions", json={**body, "logprobs": 2})
    assert reply.status_code == 200, reply.text
    tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
    return [sorted(top.values())[0] for top in tops]


def same(a: list[float], b: list[float]) -> bool:
    # Batched beside others, float32 sums differ in their last bits.
    return len(a) == len(b) and all(abs(x - y) < 1e-2 for x, y in zip(a, b, strict=True))


async def test_adapters_change_the_answer_and_keep_it_in_a_mixed_batch(
    cluster: LocalCluster, adapter_dirs: dict[str, Path]
) -> None:
    base = served_model(cluster)
    bus, _ = await observe(cluster.nats_url)
    held: list[tuple[str, ...]] = []

    async def on_load(report: WorkerLoadReported) -> None:
        held.append(report.loras)

    await bus.subscribe(Subjects.all_load, on_load)
    try:
        async with api(cluster) as http:
            for name, path in adapter_dirs.items():
                body = {"lora_name": name, "lora_path": str(path)}
                (await http.post("/load_lora_adapter", json=body)).raise_for_status()
            alone = {model: await signature(http, model) for model in (base, *ADAPTERS)}
            for i, model in enumerate(ADAPTERS):
                assert not same(alone[model], alone[base]), model
                assert all(not same(alone[model], alone[o]) for o in ADAPTERS[i + 1 :]), model

            mixed = [base, *ADAPTERS, base]
            together = await asyncio.gather(*(signature(http, m) for m in mixed))
            for model, got in zip(mixed, together, strict=True):
                assert same(got, alone[model]), (model, got, alone[model])
            await eventually(lambda: any(held) or None, timeout=10)
            assert all(len(loras) <= 2 and set(loras) <= set(ADAPTERS) for loras in held)

            missing = {"lora_name": "ad-gone", "lora_path": str(adapter_dirs["ad-a"]) + "-x"}
            (await http.post("/load_lora_adapter", json=missing)).raise_for_status()
            gone: dict[str, object] = {"model": "ad-gone", "prompt": PROMPT, "max_tokens": 4}
            failed, served = await asyncio.gather(
                http.post("/completions", json=gone), signature(http, "ad-b")
            )
            assert failed.status_code == 400, failed.text
            assert "did not load" in failed.json()["error"]["message"]
            assert same(served, alone["ad-b"])
    finally:
        await bus.close()
