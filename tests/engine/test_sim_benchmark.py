from __future__ import annotations

import random

from pytest_benchmark.fixture import BenchmarkFixture

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest
from services.engine.sim import SimConfig, SimEngine

BLOCK_SIZE = 64


def synthetic_requests(n: int) -> list[EngineRequest]:
    """Prompts built from a few shared system prompts plus a private tail, as chat traffic is."""
    rng = random.Random(0)
    systems = [tuple(rng.randrange(256) for _ in range(rng.randint(256, 4096))) for _ in range(8)]
    requests = []
    for i in range(n):
        tail = tuple(rng.randrange(256) for _ in range(rng.randint(16, 2048)))
        prompt = rng.choice(systems) + tail
        sampling = SamplingParams(max_tokens=rng.randint(16, 256))
        hashes = chain_block_hashes(prompt, BLOCK_SIZE)
        requests.append(EngineRequest(f"r{i}", prompt, sampling, hashes))
    return requests


def serve_all(requests: list[EngineRequest]) -> int:
    # Small enough a cache that evictions and preemptions happen too.
    engine = SimEngine(SimConfig(block_size=BLOCK_SIZE, num_gpu_blocks=2048))
    for request in requests:
        engine.add_request(request)
    tokens = 0
    while engine.has_work():
        tokens += len(engine.step().outputs)
    return tokens


def test_engine_throughput(benchmark: BenchmarkFixture) -> None:
    requests = synthetic_requests(300)
    tokens = benchmark(serve_all, requests)
    assert tokens == sum(r.sampling.max_tokens for r in requests)
