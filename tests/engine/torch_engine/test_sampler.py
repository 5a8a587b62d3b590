"""Token choice: greedy, temperature, nucleus cut-off and per-request seeding."""

from __future__ import annotations

import math
from collections import Counter

import torch

from schemas.events import SamplingParams
from services.engine.torch_engine.sampler import RequestSampler, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _sampler(temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> RequestSampler:
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    return RequestSampler.create(params, seed)


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [_sampler(0.0)] * 3) == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_head_reaching_the_mass() -> None:
    sampler = _sampler(top_p=0.8)
    counts = Counter(sampler.draw(PROBS.log()) for _ in range(4000))
    assert set(counts) == {0, 1}
    assert math.isclose(counts[0] / 4000, 0.5 / 0.8, abs_tol=0.03)


def test_a_tiny_top_p_is_greedy_at_any_temperature() -> None:
    sampler = _sampler(temperature=2.0, top_p=0.01)
    assert {sampler.draw(PROBS.log()) for _ in range(200)} == {0}


def test_temperature_flattens_the_distribution() -> None:
    sampler = _sampler(temperature=2.0)
    counts = Counter(sampler.draw(PROBS.log()) for _ in range(4000))
    expected = PROBS.sqrt() / PROBS.sqrt().sum()
    for token, p in enumerate(expected.tolist()):
        assert math.isclose(counts[token] / 4000, p, abs_tol=0.03)


def test_each_request_draws_from_its_own_seeded_generator() -> None:
    logits = torch.zeros(2, 1000)
    # A row's token depends on its own seed, not on its place in the batch.
    first = sample(logits, [_sampler(seed=1), _sampler(seed=2)])
    swapped = sample(logits, [_sampler(seed=2), _sampler(seed=1)])
    assert first == swapped[::-1]
    assert first[0] != first[1]
    a, b = _sampler(seed=5), _sampler(seed=5)
    assert [a.draw(logits[0]) for _ in range(20)] == [b.draw(logits[0]) for _ in range(20)]
