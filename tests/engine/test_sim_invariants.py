"""A randomized workload that drives the engine through prefix hits, evictions, preemptions and
aborts, checking after every step what a KV-event consumer and a load reader rely on."""

from __future__ import annotations

import random

import pytest

from schemas.events import SamplingParams
from services.engine.protocol import BlocksRemoved, EngineRequest, RequestOutput

from ._sim_support import fold, make_engine

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 40
MAX_NUM_SEQS = 6
MAX_NUM_BATCHED_TOKENS = 24
NUM_REQUESTS = 150


def random_request(rng: random.Random, i: int, prefixes: list[tuple[int, ...]]) -> EngineRequest:
    prompt = rng.choice(prefixes) + tuple(rng.randrange(256) for _ in range(rng.randint(1, 20)))
    stop = (ord(rng.choice("aeiou")),) if rng.random() < 0.2 else ()
    sampling = SamplingParams(max_tokens=rng.randint(1, 40), stop_token_ids=stop)
    return EngineRequest(f"r{i}", prompt, sampling)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kv_events_fold_to_the_cached_set_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(256) for _ in range(rng.randint(0, 24))) for _ in range(5)]
    engine = make_engine(BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
    requests: dict[str, EngineRequest] = {}
    outputs: dict[str, list[RequestOutput]] = {}
    aborted: set[str] = set()
    live: list[str] = []
    consumer_view: set[int] = set()
    evictions = 0

    while len(requests) < NUM_REQUESTS or engine.has_work():
        for _ in range(rng.randint(0, 2)):
            if len(requests) < NUM_REQUESTS:
                request = random_request(rng, len(requests), prefixes)
                requests[request.request_id] = request
                engine.add_request(request)
                live.append(request.request_id)
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            assert engine.abort(victim)
            aborted.add(victim)

        result = engine.step()

        fold(result.kv_changes, consumer_view)
        evictions += sum(isinstance(c, BlocksRemoved) for c in result.kv_changes)
        assert consumer_view == engine.cached_block_hashes()
        load = engine.load()
        assert 0 <= load.kv_blocks_used <= NUM_GPU_BLOCKS
        assert load.running <= MAX_NUM_SEQS
        assert load.waiting_prefill_tokens >= 0
        assert result.prefill_tokens <= MAX_NUM_BATCHED_TOKENS
        assert len(consumer_view) <= NUM_GPU_BLOCKS
        for out in result.outputs:
            assert len(out.new_token_ids) == 1
            outputs.setdefault(out.request_id, []).append(out)
            if out.finished:
                live.remove(out.request_id)

    assert engine.num_preemptions > 0
    assert evictions > 0
    load = engine.load()
    assert (load.running, load.waiting, load.waiting_prefill_tokens) == (0, 0, 0)
    assert load.kv_blocks_used == 0
    for request_id, request in requests.items():
        outs = outputs.get(request_id, [])
        if request_id in aborted:
            assert not any(o.finished for o in outs)
            continue
        assert outs[-1].finished
        assert not any(o.finished for o in outs[:-1])
        tokens = [t for o in outs for t in o.new_token_ids]
        stop = request.sampling.stop_token_ids
        if outs[-1].finish_reason == "length":
            assert len(tokens) == request.sampling.max_tokens
        else:
            assert tokens[-1] in stop
            assert len(tokens) < request.sampling.max_tokens
        assert not any(t in stop for t in tokens[:-1])
        cached = [o.cached_tokens for o in outs if o.cached_tokens is not None]
        assert len(cached) == 1
        assert outs[0].cached_tokens is not None
        whole_blocks_before_last = (len(request.prompt_token_ids) - 1) // BLOCK_SIZE
        assert outs[0].cached_tokens <= whole_blocks_before_last * BLOCK_SIZE
