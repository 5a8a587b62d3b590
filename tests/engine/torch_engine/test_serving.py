"""The torch engine end to end: `laneway make-tiny-model`, then the real services serve it to the
official openai client, streaming, through ingress, planner, kv-indexer and a torch worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from bus.client import Bus
from bus.topology import Subjects
from infra.cli import _engine_env
from schemas.events import PrefillCompleted
from tests.helpers import eventually
from tests.live import ClusterFactory


@pytest.fixture(scope="module")
def product_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    run = subprocess.run(
        [sys.executable, "-m", "infra.cli", "make-tiny-model", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    return folder


async def test_torch_engine_serves_chat_through_every_service(
    cluster_factory: ClusterFactory, product_model: Path
) -> None:
    cluster = cluster_factory(workers=1, env=_engine_env("torch", product_model))
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    messages: Any = [{"role": "user", "content": "Tell me about the river."}]
    whole = await client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=12,
        temperature=0,
    )
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    stream = await client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    # Greedy: the stream carries exactly the text of the unstreamed answer.
    assert text == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # The second identical prompt finds its prefix in the worker's paged cache.
    assert usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0


async def test_a_disaggregated_request_generates_the_aggregated_tokens(
    cluster_factory: ClusterFactory, product_model: Path
) -> None:
    """The prompt's KV computed on a prefill worker travels as tensors over NATS (chunked and
    checksummed); the decode worker continues from it to exactly the aggregated answer."""
    engine = _engine_env("torch", product_model)
    aggregated = cluster_factory(workers=1, env=engine)
    disaggregated = cluster_factory(
        workers=1, prefill_workers=1, env={**engine, "LANEWAY_DISAGG": "always"}
    )
    bus = await Bus.connect(disaggregated.nats_url, "test-observer")
    handoffs: list[PrefillCompleted] = []

    async def observe(event: PrefillCompleted) -> None:
        handoffs.append(event)

    await bus.subscribe(Subjects.all_prefilled, observe)
    story = "The river ran past the mill and the old stone bridge, " * 6
    prompts = [story + "and then", story + "until the evening came", "A short one."]
    answers: list[list[str]] = []
    try:
        for cluster in (aggregated, disaggregated):
            client = openai.AsyncOpenAI(
                base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
            )
            texts = []
            for prompt in prompts:
                answer = await client.completions.create(
                    model="tiny-llama", prompt=prompt, max_tokens=16, temperature=0
                )
                texts.append(answer.choices[0].text)
            answers.append(texts)
        assert all(answers[0]) and answers[0] == answers[1]
        await eventually(lambda: len(handoffs) >= len(prompts))
        assert len(handoffs) == len(prompts)
        assert all(h.error is None for h in handoffs)
        # The long prompts' blocks went over as tensors; the second found the first's prefix
        # cached on the prefill worker.
        assert handoffs[0].payload is not None and handoffs[0].payload.size > 0
        assert handoffs[1].cached_tokens > 0
    finally:
        await bus.close()
