"""The context limit follows the engine: a sim cluster serves prompts as long as its KV pool
holds, and answers longer ones with a clean 400; `laneway up --max-model-len` sets a lower one."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from infra import cli
from infra import cluster as cluster_module
from infra.cluster import LocalCluster
from infra.cluster_plan import ClusterConfig
from tests.live import ClusterFactory

MODEL = "laneway-sim"
# 4096 blocks of 16 tokens: 65,536 tokens of context, twice the old fixed limit.
POOL = {"LANEWAY_BLOCK_SIZE": "16", "LANEWAY_NUM_GPU_BLOCKS": "4096"}


async def test_prompts_as_long_as_the_sims_pool_holds_are_served(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1, env=POOL)
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    served = await client.completions.create(model=MODEL, prompt="x" * 40_000, max_tokens=4)
    assert served.usage is not None
    assert (served.usage.prompt_tokens, served.usage.completion_tokens) == (40_000, 4)

    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt="x" * 65_533, max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 65536 tokens" in refused.value.message
    # Without max_tokens the completion takes the room that is left.
    rest = await client.completions.create(model=MODEL, prompt="x" * 65_534)
    assert rest.usage is not None and rest.usage.completion_tokens == 2


class _Captured(Exception):
    pass


def _up_env(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, str]:
    """The settings `laneway up` would give its services."""
    seen: dict[str, Any] = {}

    class Recorder(LocalCluster):
        def __init__(self, config: ClusterConfig) -> None:
            seen["env"] = config.env
            raise _Captured

    # `laneway up` imports the cluster when it runs (a command imports its own modules alone).
    monkeypatch.setattr(cluster_module, "LocalCluster", Recorder)
    with pytest.raises(_Captured):
        cli.main(["up", *argv])
    env: dict[str, str] = seen["env"]
    return env


def test_up_passes_max_model_len_to_the_services(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "LANEWAY_MAX_MODEL_LEN" not in _up_env(monkeypatch)
    assert _up_env(monkeypatch, "--max-model-len", "100000")["LANEWAY_MAX_MODEL_LEN"] == "100000"


def test_up_refuses_a_model_for_the_sim() -> None:
    with pytest.raises(SystemExit, match="--model is for --engine torch, trtllm or vllm"):
        cli.main(["up", "--model", "models/tiny"])
