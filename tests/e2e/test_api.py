"""The OpenAI API end to end: the official client against real processes over NATS and etcd."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import openai
import pytest

from bus.client import Bus
from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import Event, RequestCancelled
from schemas.messages import OverlapQuery
from services.common.tokenizer import ByteTokenizer
from tests.helpers import eventually
from tests.live import ClusterFactory, api_block_hashes, registrations

MODEL = "laneway-sim"


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory, spans_file: Path) -> LocalCluster:
    return cluster_factory(workers=2, env={"LANEWAY_TRACE_EXPORTER": f"file:{spans_file}"})


@pytest.fixture
def client(cluster: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )


def chat_prompt_tokens(content: str) -> int:
    return len(
        ByteTokenizer().encode(f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n")
    )


async def test_models_lists_the_served_model(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_completion_with_usage(client: openai.AsyncOpenAI) -> None:
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len(choice.message.content or "") == 12  # byte tokens, ASCII text
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == chat_prompt_tokens("hello")
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


async def test_streamed_chat_equals_unstreamed_for_a_seed(client: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "tell me a story"}]
    whole = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=40,
        seed=5,  # type: ignore[arg-type]
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=40,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 40


async def test_completions_stream_and_not(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=9, seed=2)
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (9, 9)
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=9, seed=2, stream=True
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == whole.choices[0].text


async def test_stop_string_ends_generation(client: openai.AsyncOpenAI) -> None:
    free = await client.completions.create(model=MODEL, prompt="x", max_tokens=60, seed=3)
    text = free.choices[0].text
    stop = text[20:22]
    first = text.find(stop)
    stopped = await client.completions.create(
        model=MODEL, prompt="x", max_tokens=60, seed=3, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:first]
    # Generated up to the token that completed the stop string, and no further (a step at a
    # time, though decode steps at a high speed-up otherwise go many at once).
    assert stopped.usage is not None
    assert stopped.usage.completion_tokens == len((text[:first] + stop).encode())


async def test_repeated_prompt_is_served_from_cache(client: openai.AsyncOpenAI) -> None:
    prompt = "the same long context " * 20
    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, user="same-user")
    await asyncio.sleep(0.3)
    cached = 0
    for _ in range(4):  # whichever worker it lands on, one of them has the prefix after two
        again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached = max(cached, again.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached >= 16 * ((len(prompt) - 1) // 16) - 16


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
async def test_invalid_parameters_are_400_naming_the_field(
    client: openai.AsyncOpenAI, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            **kwargs,  # type: ignore[arg-type,call-overload]
        )
    assert err.value.status_code == 400
    assert err.value.param == param


async def test_a_response_format_sim_workers_cannot_keep_is_400_naming_sim(
    client: openai.AsyncOpenAI, cluster: LocalCluster
) -> None:
    # The workers registered that they do no structured outputs, and the ingress followed.
    workers = await registrations(cluster.etcd_endpoints)
    assert workers and not any(w.structured_outputs for w in workers.values())
    schema = {"name": "colour", "schema": {"enum": ["red", "green"]}, "strict": True}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": schema},
        )
    assert err.value.param == "response_format"
    assert err.value.body == {
        "message": "response_format json_schema needs workers whose engine does structured "
        f"outputs (vllm); model '{MODEL}' is served by sim.",
        "type": "invalid_request_error",
        "param": "response_format",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(
            model=MODEL, prompt="hi", extra_body={"response_format": {"type": "json_object"}}
        )
    assert err.value.param == "response_format" and "served by sim" in err.value.message


async def test_missing_messages_is_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=[])
    assert err.value.param == "messages"


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        await client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.code == "model_not_found"


async def test_prompt_too_long_is_rejected(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        # Past what a default sim worker holds: 16,384 KV blocks of 16 tokens.
        await client.completions.create(model=MODEL, prompt="x" * 262_144, max_tokens=1)
    assert err.value.code == "context_length_exceeded"
    assert "maximum context length is 262144 tokens" in err.value.message


async def test_a_prompt_past_natss_default_payload_is_served(client: openai.AsyncOpenAI) -> None:
    # 200,000 token ids and their block hashes make a request event over NATS's default 1 MiB.
    answer = await client.completions.create(model=MODEL, prompt="y" * 200_000, max_tokens=2)
    assert answer.usage is not None and answer.usage.prompt_tokens == 200_000


async def test_client_disconnect_cancels_the_request(
    client: openai.AsyncOpenAI, cluster: LocalCluster
) -> None:
    bus = await Bus.connect(cluster.nats_url, "test-observer")
    ended: list[Event] = []
    await bus.subscribe(Subjects.all_request_terminals, lambda e: _append(ended, e))
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go on forever"}],
        max_tokens=5000,
        stream=True,
    )
    async for _chunk in stream:
        break
    await stream.close()
    await eventually(lambda: any(isinstance(e, RequestCancelled) for e in ended))
    await bus.close()
    cancelled = [e for e in ended if isinstance(e, RequestCancelled)]
    assert len(cancelled) == 1
    assert cancelled[0].reason == "client_disconnected"
    assert 0 < cancelled[0].completion_tokens < 5000


async def _append(sink: list[Event], event: Event) -> None:
    sink.append(event)


async def test_one_request_is_one_trace_across_processes(
    client: openai.AsyncOpenAI, spans_file: Path
) -> None:
    reply = await client.completions.create(model=MODEL, prompt="trace me", max_tokens=3)
    request_id = reply.id.removeprefix("cmpl-")

    def request_traces() -> dict[str, set[str]]:
        """The services of each trace of the request (the worker's spans are written last)."""
        found: dict[str, set[str]] = defaultdict(set)
        for line in spans_file.read_text().splitlines():
            span = json.loads(line)
            if span["attributes"].get("laneway.request_id") == request_id:
                found[span["trace_id"]].add(span["service"])
        return found if any("laneway-worker" in s for s in found.values()) else {}

    traces = await eventually(request_traces)
    assert len(traces) == 1
    assert next(iter(traces.values())) == {
        "laneway-ingress",
        "laneway-planner",
        "laneway-worker",
    }


async def test_metrics_are_prometheus_text(cluster: LocalCluster) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        body = (await http.get(cluster.config.base_url.removesuffix("/v1") + "/metrics")).text
    assert "# TYPE" in body


async def test_no_worker_is_503(cluster_factory: ClusterFactory) -> None:
    empty = cluster_factory(workers=0)
    client = openai.AsyncOpenAI(
        base_url=empty.config.base_url, api_key=empty.api_key, max_retries=0
    )
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model=MODEL, prompt="anyone?", max_tokens=2)
    assert err.value.status_code == 503


async def test_timeout_is_504(cluster_factory: ClusterFactory) -> None:
    slow = cluster_factory(
        workers=1, env={"LANEWAY_REQUEST_TIMEOUT_S": "1", "LANEWAY_SPEEDUP": "0.05"}
    )
    client = openai.AsyncOpenAI(base_url=slow.config.base_url, api_key=slow.api_key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model=MODEL, prompt="slowly", max_tokens=500)
    assert err.value.status_code == 504


async def test_kv_indexer_knows_where_a_prompt_is_cached(
    client: openai.AsyncOpenAI, cluster: LocalCluster
) -> None:
    prompt = "index this prefix please " * 8  # 200 bytes: 12 full blocks of 16
    reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert reply.usage is not None
    hashes = await api_block_hashes(cluster, ByteTokenizer().encode(prompt), 16)
    bus = await Bus.connect(cluster.nats_url, "test-indexer-query")

    async def overlaps() -> dict[str, int]:
        query = OverlapQuery(block_hashes=hashes)
        return (await bus.request(Subjects.overlap_query, query, timeout=2)).overlaps

    found = await eventually(overlaps, message="KV events never reached the indexer")
    await bus.close()
    assert list(found.values()) == [len(hashes)]
