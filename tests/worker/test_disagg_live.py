"""Disaggregation through the real services: a prefill worker computes the prompt, hands its KV to
the decode worker, which streams every token; a hand-off that never comes costs a local prefill,
never the request."""

from __future__ import annotations

import os
import signal

import openai

from schemas.events import (
    KvTransferred,
    PrefillCompleted,
    RequestFinished,
    RouteDecided,
    TokensGenerated,
)
from tests.helpers import eventually
from tests.live import ClusterFactory, observe, registrations

MODEL = "laneway-sim"
# Every prompt prefilled remotely, with the sim's modelled link.
ALWAYS = {"LANEWAY_DISAGG": "always", "LANEWAY_HANDOFF_TIMEOUT_S": "2"}


async def test_a_remote_prefill_hands_its_kv_to_the_decode_worker(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1, prefill_workers=1, env=ALWAYS)
    bus, seen = await observe(cluster.nats_url)
    workers = await registrations(cluster.etcd_endpoints)
    prefill = next(w for w, r in workers.items() if r.role == "prefill")
    decode = next(w for w, r in workers.items() if r.role == "decode")
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    prompt = "the prompt of a disaggregated request " * 8
    try:
        for stream in (False, True):
            if stream:
                chunks = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=12, stream=True
                )
                text = "".join([c.choices[0].text async for c in chunks if c.choices])
                assert text
            else:
                answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
                assert answer.usage is not None and answer.usage.completion_tokens == 12
        # The observer hears of events a moment after the client does.
        await eventually(lambda: len(seen.events["RequestFinished"]) == 2)
        finished = [e for e in seen.events["RequestFinished"] if isinstance(e, RequestFinished)]
        for done in finished:
            rid = done.request_id or ""
            routes = [e for e in seen.of(RouteDecided, rid) if isinstance(e, RouteDecided)]
            assert {r.worker_id for r in routes} == {decode}
            assert routes[0].prefill is not None
            assert routes[0].prefill.prefill_worker_id == prefill
            assert [c.worker_id for c in routes[0].prefill.candidates] == [prefill]
            completed = seen.of(PrefillCompleted, rid)
            assert len(completed) == 1 and isinstance(completed[0], PrefillCompleted)
            assert completed[0].error is None and completed[0].block_hashes
            moved = seen.of(KvTransferred, rid)
            assert len(moved) == 1 and isinstance(moved[0], KvTransferred)
            assert moved[0].from_worker_id == prefill and moved[0].to_worker_id == decode
            # Every token comes from the decode worker, once, in order.
            deltas = [e for e in seen.of(TokensGenerated, rid) if isinstance(e, TokensGenerated)]
            assert {d.worker_id for d in deltas} == {decode}
            indexes = [i for d in deltas for i in range(d.index, d.index + len(d.token_ids))]
            assert indexes == list(range(12))
            # One gap per token after the first, the first of them the hand-off's.
            assert done.token_gaps.total() == 11
            # The sim engine takes the whole prompt's KV: the decode worker computes none of
            # it, so no step of the answer carries prompt tokens (the partial last block's).
            assert done.stalled_gaps == 0
            assert done.worker_id == decode and done.usage.completion_tokens == 12
    finally:
        await bus.close()


async def test_a_lost_prefill_worker_costs_a_local_prefill_not_the_request(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=1, prefill_workers=1, env=ALWAYS)
    bus, seen = await observe(cluster.nats_url)
    workers = await registrations(cluster.etcd_endpoints)
    prefill = next(r for r in workers.values() if r.role == "prefill")
    # Stopped, not killed: its lease stays until it expires, so the planner still sends it the
    # prompt, and nobody answers.
    os.kill(prefill.pid, signal.SIGSTOP)
    client = openai.AsyncOpenAI(
        base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
    )
    try:
        answer = await client.completions.create(
            model=MODEL, prompt="a prompt nobody prefills " * 8, max_tokens=6, timeout=30
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 6
        rid = answer.id.removeprefix("cmpl-")
        routes = [e for e in seen.of(RouteDecided, rid) if isinstance(e, RouteDecided)]
        assert routes and routes[0].prefill is not None
        assert routes[0].prefill.prefill_worker_id == prefill.worker_id
        assert not seen.of(KvTransferred, rid)
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
        await bus.close()
