"""A worker reports, per request, how many of its token gaps waited on someone's prefill: the
capacity loop's evidence that splitting off a prefill pool could speed tokens up."""

from __future__ import annotations

import asyncio

import openai

from schemas.events import RequestFinished
from tests.helpers import eventually
from tests.live import ClusterFactory, observe

MODEL = "laneway-sim"


async def test_a_prefill_during_a_decode_stalls_its_gaps(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=1)
    bus, seen = await observe(cluster.nats_url)
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    try:
        decoding = await client.completions.create(
            model=MODEL, prompt="a short prompt", max_tokens=300, stream=True
        )
        chunks = aiter(decoding)
        await anext(chunks)  # decoding has started
        # A long prompt lands on the same worker while the first request decodes.
        late = asyncio.create_task(
            client.completions.create(model=MODEL, prompt="long prompt " * 1500, max_tokens=20)
        )
        async for _ in chunks:
            pass
        await late
        await eventually(lambda: len(seen.events["RequestFinished"]) == 2)
    finally:
        await bus.close()
    first, second = (e for e in seen.events["RequestFinished"] if isinstance(e, RequestFinished))
    if first.usage.prompt_tokens > second.usage.prompt_tokens:
        first, second = second, first
    assert first.token_gaps.total() == 299 and second.token_gaps.total() == 19
    # The long prompt's prefill shared a step with the first request's decode; nothing
    # prefilled while the second decoded.
    assert first.stalled_gaps >= 1
    assert second.stalled_gaps == 0
