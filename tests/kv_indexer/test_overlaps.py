"""Overlap queries: the galloping search against the exact walk and the plainest model."""

from __future__ import annotations

import random

import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.common.kv_index.index import PrefixIndex
from services.engine.kv_events import kv_changed
from services.engine.protocol import EngineRequest
from services.engine.sim import SimConfig, SimEngine


def walk(cached: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    result = {}
    for name, held in cached.items():
        depth = 0
        while depth < len(query) and query[depth] in held:
            depth += 1
        if depth:
            result[name] = depth
    return result


def chain_tree(rng: random.Random, chains: int) -> list[list[int]]:
    tree = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 300))]]
    for _ in range(chains - 1):
        parent = rng.choice(tree)
        tail = [rng.getrandbits(64) for _ in range(rng.randrange(1, 300))]
        tree.append(parent[: rng.randrange(len(parent) + 1)] + tail)
    return tree


@pytest.mark.parametrize("seed", range(10))
def test_galloping_is_exact_on_prefix_closed_caches(seed: int) -> None:
    rng = random.Random(seed)
    tree = chain_tree(rng, 30)
    index = PrefixIndex()
    cached: dict[str, set[int]] = {}
    for w in range(rng.randrange(1, 20)):
        name = f"w{w}"
        for chain in rng.sample(tree, rng.randrange(1, 8)):
            prefix = chain[: rng.randrange(len(chain) + 1)]
            index.store(name, prefix)
            cached.setdefault(name, set()).update(prefix)
    for chain in tree:
        for query in (chain, chain[: rng.randrange(len(chain) + 1)], [*chain, 1, 2, 3]):
            expected = walk(cached, query)
            assert index.overlaps(query) == expected
            assert index.overlaps(query, exact=True) == expected


def test_exact_walk_stops_at_a_hole() -> None:
    index = PrefixIndex()
    index.store("a", [0, 1, 2, 3, *range(6, 100)])
    index.store("b", range(100))
    assert index.overlaps(range(100), exact=True) == {"a": 4, "b": 100}


@pytest.mark.parametrize("query", [[], [404], [404, 1]])
def test_nothing_cached_means_no_overlap(query: list[int]) -> None:
    index = PrefixIndex()
    index.store("a", [1, 2])
    assert index.overlaps(query) == index.overlaps(query, exact=True) == {}


@pytest.mark.parametrize("seed", range(3))
def test_the_sim_engines_caches_are_prefix_closed(seed: int) -> None:
    # The galloping search leans on this; the sim engine stands in for vLLM's prefix cache.
    rng = random.Random(seed)
    config = SimConfig(block_size=4, num_gpu_blocks=96, max_num_seqs=4, max_num_batched_tokens=64)
    engines = {f"w{i}": SimEngine(config) for i in range(3)}
    seqs = dict.fromkeys(engines, 0)
    index = PrefixIndex()
    conversations: list[list[int]] = [[] for _ in range(8)]
    prompts: list[tuple[int, ...]] = []
    for r in range(120):
        history = rng.choice(conversations)
        history += [rng.randrange(1000) for _ in range(rng.randrange(4, 40))]
        del history[: max(0, len(history) - 200)]
        prompts.append(chain_block_hashes(history, config.block_size))
        name = rng.choice(list(engines))
        sampling = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)
        engines[name].add_request(EngineRequest(f"r{r}", list(history), sampling))
        for name, engine in engines.items():
            for _ in range(rng.randrange(3)):
                changes = engine.step().kv_changes
                if changes:
                    seqs[name] += 1
                    index.apply(kv_changed(changes, name, seqs[name]))
        for query in prompts[-20:]:
            assert index.overlaps(query) == index.overlaps(query, exact=True)
    assert index.size > 0
