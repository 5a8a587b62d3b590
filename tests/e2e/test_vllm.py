"""vLLM behind the whole live system: two workers running vLLM's engine (its CPU build) over
`laneway make-tiny-model`'s checkpoint, served through the real ingress, planner and kv-indexer.

- Greedy answers to token-id prompts are vLLM's own (``LLM.generate`` on the same ids, computed
  in a process of its own while the cluster loads).
- vLLM's KV events reach the planner: a repeated prompt is routed to the worker that holds it,
  the planner's candidate says how many blocks, and the cached tokens the client gets are vLLM's
  own count.
- A client that goes away aborts the request in vLLM; a worker killed mid-stream has its streams
  continued on the other, each exact; one stopped with SIGTERM drains.

The module's tests share one cluster (its workers take 15-40 s to load), in one xdist worker."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import (
    Event,
    RequestCancelled,
    RouteDecided,
    TokensGenerated,
    WorkerLoadReported,
)
from schemas.kv_events import KvChanged, StoredRun
from services.common.hf_tokenizer import HfTokenizer
from tests.e2e.exact import Streamed, mismatch, stream
from tests.e2e.moves import observe_moves
from tests.e2e.vllm_cluster import api, served_model, vllm_env
from tests.e2e.vllm_reference import TOP_LOGPROBS, Reference
from tests.helpers import eventually
from tests.ingress.helpers import sse_data
from tests.live import ClusterFactory, api_block_hashes, observe, registrations

pytestmark = pytest.mark.xdist_group("vllm-e2e")

# Token-id prompts of 40 to 160 tokens inside the tiny model's vocabulary (2,048; the first
# three are its special tokens), seeded: the same on every run.
_RNG = random.Random(37)
PROMPTS = [[_RNG.randrange(3, 2000) for _ in range(_RNG.randrange(40, 160))] for _ in range(12)]
MAX_TOKENS = 160
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def reference(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """vLLM's greedy answers, computed beside the cluster's start."""
    ref = Reference(vllm_model, PROMPTS, MAX_TOKENS, tmp_path_factory.mktemp("vllm-reference"))
    yield ref
    ref.stop()


@pytest.fixture(scope="module")
def cluster(
    cluster_factory: ClusterFactory, vllm_model: Path, reference: Reference
) -> LocalCluster:
    env = {**vllm_env(vllm_model), "LANEWAY_DRAIN_TIMEOUT_S": "30"}
    return cluster_factory(workers=2, env=env, start_timeout=240)


@pytest.fixture(scope="module")
def expected(reference: Reference, vllm_model: Path) -> dict[int, str]:
    """vLLM's greedy answer to each prompt, as text."""
    tokenizer = HfTokenizer(vllm_model)
    return {i: tokenizer.decode(ids) for i, ids in enumerate(reference.answers())}


@pytest.fixture
async def http(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with api(cluster) as client:
        yield client


def _body(cluster: LocalCluster, i: int, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {
        "model": served_model(cluster),
        "prompt": PROMPTS[i],
        "max_tokens": max_tokens,
        **GREEDY,
    }


async def test_greedy_answers_are_vllms_own(
    cluster: LocalCluster, http: httpx.AsyncClient, expected: dict[int, str]
) -> None:
    async def one(i: int) -> str:
        reply = (await http.post("/completions", json=_body(cluster, i))).raise_for_status()
        body = reply.json()
        assert body["usage"]["prompt_tokens"] == len(PROMPTS[i])
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        text: str = body["choices"][0]["text"]
        return text

    answers = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    assert dict(enumerate(answers)) == expected
    # Streamed, the same text: every token once, in order.
    streamed = await asyncio.gather(*(_stream(http, cluster, i) for i in range(4)))
    _assert_exact(streamed, expected)


async def test_log_probabilities_are_vllms_own(
    cluster: LocalCluster, http: httpx.AsyncClient, reference: Reference, vllm_model: Path
) -> None:
    tokenizer = HfTokenizer(vllm_model)
    wanted = reference.logprobs()
    for i in range(3):
        body = {**_body(cluster, i, max_tokens=24), "logprobs": TOP_LOGPROBS}
        whole = (await http.post("/completions", json=body)).raise_for_status().json()
        got = whole["choices"][0]["logprobs"]
        assert len(got["token_logprobs"]) == 24
        ids = reference.answers()[i][:24]
        assert got["tokens"] == [tokenizer.decode([t]) for t in ids]
        for position, (logprob, top) in enumerate(wanted[i][:24]):
            # Batched beside other requests, float32 sums differ in their last bits.
            assert got["token_logprobs"][position] == pytest.approx(logprob, abs=1e-3)
            # The legacy shape keys them by text: tokens that decode alike (parts of characters)
            # share a key, so only the others can be told apart.
            texts = [tokenizer.decode([t]) for t in (ids[position], *(t for t, _ in top))]
            named = {text: lp for text, (_, lp) in zip(texts[1:], top, strict=True)}
            named = {text: lp for text, lp in named.items() if texts.count(text) == 1}
            seen = got["top_logprobs"][position]
            assert set(named) <= set(seen), (position, named, seen)
            assert all(seen[t] == pytest.approx(lp, abs=1e-3) for t, lp in named.items()), (
                position,
                named,
                seen,
            )
        # Streamed on chat's shape, the same tokens once each.
        chat = {
            "model": served_model(cluster),
            "messages": [{"role": "user", "content": f"story {i}"}],
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 1,
            "stream": True,
            **GREEDY,
        }
        raw = (await http.post("/chat/completions", json=chat)).raise_for_status().text
        chunks = [c for c in sse_data(raw) if c != "[DONE]" and c["choices"]]
        carried = [c["choices"][0]["logprobs"] for c in chunks]
        content = [e for part in carried if part for e in part["content"]]
        assert len(content) == 8
        for e in content:
            assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the most likely


async def test_the_planner_weighs_what_vllm_workers_measured_and_declared(
    cluster: LocalCluster, http: httpx.AsyncClient, vllm_model: Path
) -> None:
    bus, seen = await observe(cluster.nats_url)
    # Prompts of their own (none cached), one at a time: each worker prefills and decodes.
    ids = []
    for k in range(24):
        prompt = [3 + (k * 131 + 17 * j) % 1990 for j in range(40 + 8 * k)]
        body = {"model": served_model(cluster), "prompt": prompt, "max_tokens": 12, **GREEDY}
        ids.append((await http.post("/completions", json=body)).raise_for_status().json()["id"])
    await eventually(lambda: seen.of(RouteDecided, ids[-1].removeprefix("cmpl-")), timeout=5)
    await bus.close()
    candidates = [
        c
        for event in seen.events["RouteDecided"]
        if isinstance(event, RouteDecided)
        for c in event.candidates
    ]
    measured = {c.worker_id: c.step_cost for c in candidates if c.step_cost is not None}
    # Both workers measured their steps, and the planner weighed them with those costs (the
    # decisions record them, so a replay predicts alike).
    workers = await registrations(cluster.etcd_endpoints)
    assert set(measured) == set(workers), measured
    # Each declared its KV's size, which prices moves and hand-offs: the tiny model's K and V
    # in float32.
    config = json.loads((vllm_model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    size = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert {w.kv_bytes_per_token for w in workers.values()} == {size}
    assert {c.kv_bytes_per_token for c in candidates} == {size}
    for cost in measured.values():
        assert cost is not None
        # The tiny model on 2 shared CPU cores: far from the preset's 16.5 ms + 0.015 ms a token.
        assert 0 < cost.prefill_ms_per_token < 5 and cost.decode_step_ms > 0, cost


async def _stream(
    http: httpx.AsyncClient, cluster: LocalCluster, i: int, max_tokens: int = MAX_TOKENS
) -> Streamed:
    return await stream(
        http, i, max_tokens, model=served_model(cluster), prompt=PROMPTS[i], **GREEDY
    )


def _assert_exact(streamed: list[Streamed], expected: dict[int, str]) -> None:
    wrong = [m for s in streamed if (m := mismatch(s, expected[s.seed], byte_tokens=False))]
    assert not wrong, "\n".join(wrong)  # in full: pytest's diff would cut the texts


async def test_vllms_kv_events_route_a_repeat_to_the_worker_holding_it(
    cluster: LocalCluster, http: httpx.AsyncClient
) -> None:
    bus, seen = await observe(cluster.nats_url)
    stored: dict[str, set[int]] = defaultdict(set)
    loads: dict[str, WorkerLoadReported] = {}

    async def on_event(event: Event) -> None:
        if isinstance(event, WorkerLoadReported):
            loads[event.worker_id] = event
        if isinstance(event, KvChanged):
            for change in event.changes:
                if isinstance(change, StoredRun):
                    stored[event.worker_id].update(change.block_hashes)

    await bus.subscribe(Subjects.all_kv, on_event)
    await bus.subscribe(Subjects.all_load, on_event)
    # A prompt of its own (3 full blocks of 32 and 7 tokens), then again with another ending.
    prompt = [5 + (7 * k) % 1990 for k in range(103)]
    hashes = set(await api_block_hashes(cluster, prompt, 32))
    replies = []
    for tokens in (prompt, [*prompt[:96], 11, 12, 13, 14, 15]):
        body = {"model": served_model(cluster), "prompt": tokens, "max_tokens": 4, **GREEDY}
        replies.append((await http.post("/completions", json=body)).raise_for_status().json())
        # vLLM's events for the prompt's blocks, in Laneway's hashes, from one worker; and both
        # workers idle again as they report it, so that their cache alone tells them apart.
        await eventually(lambda: [w for w, blocks in stored.items() if hashes <= blocks], timeout=5)
        loads.clear()
        await eventually(
            lambda: len(loads) == 2 and not any(r.running or r.waiting for r in loads.values()),
            timeout=10,
        )
    first, repeat = (r["id"].removeprefix("cmpl-") for r in replies)
    await eventually(lambda: seen.of(RouteDecided, repeat), timeout=5)
    [held] = seen.of(RouteDecided, first)
    [route] = seen.of(RouteDecided, repeat)
    assert isinstance(held, RouteDecided) and isinstance(route, RouteDecided)
    # The planner knew the worker held the first three blocks (from vLLM's events, as the
    # workers register kv_events: the indexer does not guess) and sent the repeat there.
    candidates = {c.worker_id: c for c in route.candidates}
    assert [w for w, blocks in stored.items() if hashes <= blocks] == [held.worker_id]
    assert route.worker_id == held.worker_id, route.candidates
    assert candidates[route.worker_id].cached_blocks == 3
    assert candidates[route.worker_id].block_size == 32
    assert all(c.cached_blocks == 0 for w, c in candidates.items() if w != route.worker_id)
    # vLLM's own count: the three blocks it found, not the planner's estimate.
    assert replies[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # `laneway explain` shows it from the cluster's log.
    explain = ["explain", repeat, "--nats-url", cluster.nats_url, "--json"]
    explained = subprocess.run(
        [sys.executable, "-m", "infra.cli", *explain],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    [chosen] = [c for c in json.loads(explained)["candidates"] if c["chosen"]]
    assert (chosen["worker_id"], chosen["cached_blocks"]) == (route.worker_id, 3)
    await bus.close()


async def test_a_client_that_goes_away_aborts_the_request_in_vllm(
    cluster: LocalCluster, http: httpx.AsyncClient
) -> None:
    """A 3,000-token answer; the client leaves at its first chunk. The request is cancelled, and
    the engines' own queues (as the workers report them) are empty again within seconds, long
    before the answer could have ended."""
    bus, seen = await observe(cluster.nats_url)
    loads: dict[str, WorkerLoadReported] = {}

    async def on_load(event: Event) -> None:
        if isinstance(event, WorkerLoadReported):
            loads[event.worker_id] = event

    await bus.subscribe(Subjects.all_load, on_load)
    body = {**_body(cluster, 0, max_tokens=3000), "stream": True}
    async with http.stream("POST", "/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                [chunk] = sse_data(line + "\n\n")
                request_id = chunk["id"].removeprefix("cmpl-")
                break
    await eventually(lambda: seen.of(RequestCancelled, request_id), timeout=10)
    loads.clear()
    await eventually(
        lambda: len(loads) == 2 and not any(r.running or r.waiting for r in loads.values()),
        timeout=10,
    )
    batches = [t for t in seen.of(TokensGenerated, request_id) if isinstance(t, TokensGenerated)]
    generated = sum(len(t.token_ids) for t in batches)
    assert 0 < generated < 3000
    await bus.close()


async def test_a_vllm_worker_stopped_with_sigterm_drains(
    cluster: LocalCluster, http: httpx.AsyncClient, expected: dict[int, str]
) -> None:
    """SIGTERM: the worker takes nothing new, finishes what it runs (its drain allows 30 s, the
    streams need a few) and exits; every stream is exact, none moved. Then it starts again."""
    bus, moves = await observe_moves(cluster)
    observer, seen = await observe(cluster.nats_url)
    workers = await registrations(cluster.etcd_endpoints)
    streams = [asyncio.create_task(_stream(http, cluster, i)) for i in range(len(PROMPTS))]
    victim = (await moves.victim(workers)).worker_id
    # Every stream placed first: one routed after the signal would be handed on, not drained.
    await eventually(lambda: len(seen.events["RouteDecided"]) >= len(PROMPTS), timeout=10)
    [service] = [s for s in cluster.services if s.env.get("LANEWAY_WORKER_ID") == victim]
    assert service.proc is not None
    service.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(asyncio.to_thread(service.proc.wait), 60) == 0
    streamed = await asyncio.gather(*streams)
    _assert_exact(streamed, expected)
    assert moves.routes == []
    await bus.close()
    await observer.close()
    cluster.spawn(service)

    async def back() -> bool:
        return victim in await registrations(cluster.etcd_endpoints)

    await eventually(back, timeout=120)


async def test_a_killed_vllm_workers_streams_continue_exactly(
    cluster: LocalCluster,
    http: httpx.AsyncClient,
    expected: dict[int, str],
    reference: Reference,
) -> None:
    """Greedy streams on both workers; one is SIGKILLed under them. Each stream still ends with
    vLLM's own answer: the prompt and the tokens delivered were continued on the other worker."""
    bus, moves = await observe_moves(cluster)
    workers = await registrations(cluster.etcd_endpoints)
    streams = [asyncio.create_task(_stream(http, cluster, i)) for i in range(len(PROMPTS))]
    # The worker given most of the streams: the one given fewest (a stream or two, on a worker
    # just started again by the test before) could have ended them before the kill.
    victim = await moves.victim(workers, most=True)
    await asyncio.sleep(0.5)
    os.kill(victim.pid, signal.SIGKILL)
    streamed = await asyncio.gather(*streams)
    assert moves.routes, "no stream was on the killed worker"
    # Each continuation's prompt: the client's, then vLLM's answer as far as it was delivered.
    for route in moves.routes:
        spec = route.spec
        [i] = [i for i, p in enumerate(PROMPTS) if tuple(p) == spec.prompt_token_ids[: len(p)]]
        offset = spec.sampling.offset
        assert spec.prompt_token_ids[len(PROMPTS[i]) :] == tuple(reference.answers()[i][:offset])
    _assert_exact(streamed, expected)
    assert {r.worker_id for r in moves.routes} == set(workers) - {victim.worker_id}
    await bus.close()
