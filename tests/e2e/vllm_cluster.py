"""The vLLM end-to-end clusters: their workers' settings, and a client of their API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from infra.cluster import LocalCluster
from infra.engine_env import engine_env


def vllm_env(model: Path) -> dict[str, str]:
    """`laneway up --engine vllm`'s, with a small KV cache (64 MiB: 16,384 tokens of the tiny
    model) and no torch.compile: its warm-up took 67 s of a worker's 85 s start on 2 loaded cores
    (the model folder is new each run, so its compile cache misses), and no test here times
    steps."""
    return {
        **engine_env("vllm", model),
        "LANEWAY_KV_CACHE_GIB": "0.0625",
        "LANEWAY_VLLM_ARGS": json.dumps({"enforce_eager": True}),
    }


def served_model(cluster: LocalCluster) -> str:
    return cluster.config.env["LANEWAY_MODEL"]


@asynccontextmanager
async def api(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the cluster's API with its key; a tiny model's answers on loaded cores can
    take a minute."""
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=120
    ) as client:
        yield client
