"""The step costs a worker on real hardware reports: a fit to the steps it ran."""

from __future__ import annotations

import random

import pytest

from services.worker.step_cost import StepCostFit


def run(fit: StepCostFit, steps: int, truth: tuple[float, float, float, float], seed: int) -> None:
    """Steps of a chunked-prefill engine: some prefill (some of them beside decodes), some only
    decode, with noise."""
    base, per_token, decode, per_seq = truth
    rng = random.Random(seed)
    for _ in range(steps):
        prefill = rng.choice([0, 0, rng.randint(16, 2048)])
        seqs = rng.randint(0 if prefill else 1, 8)
        ms = (base + per_token * prefill if prefill else 0.0) + (
            decode + per_seq * seqs if seqs else 0.0
        )
        fit.observe(prefill, seqs, ms * rng.uniform(0.97, 1.03))


def test_it_finds_the_hardwares_step_costs() -> None:
    fit = StepCostFit()
    run(fit, 400, (6.0, 0.07, 9.0, 0.5), seed=1)
    cost = fit.estimate()
    assert cost is not None
    assert cost.prefill_ms_per_token == pytest.approx(0.07, rel=0.05)
    assert cost.decode_step_ms == pytest.approx(9.0, rel=0.15)
    assert cost.prefill_step_ms == pytest.approx(6.0, abs=2.0)
    assert cost.decode_ms_per_seq == pytest.approx(0.5, abs=0.3)


def test_nothing_until_both_kinds_of_step_were_seen() -> None:
    fit = StepCostFit(min_steps=8)
    for _ in range(50):
        fit.observe(512, 0, 40.0)  # prefills only
    assert fit.estimate() is None
    fit.observe(0, 0, 3.0)  # an empty step says nothing
    for _ in range(7):
        fit.observe(0, 2, 10.0)
    assert fit.estimate() is None
    fit.observe(0, 2, 10.0)
    assert fit.estimate() is not None


def test_no_part_is_negative() -> None:
    # Decode steps cost less with more sequences (noise, caches): a least-squares fit would give
    # a negative part per sequence, which a prediction must never use.
    fit = StepCostFit(min_steps=1)
    for seqs, ms in [(1, 12.0), (4, 10.0), (8, 8.0)] * 5:
        fit.observe(0, seqs, ms)
    for tokens in (100, 400, 1600):
        fit.observe(tokens, 0, 5.0 + 0.05 * tokens)
    cost = fit.estimate()
    assert cost is not None
    assert cost.decode_ms_per_seq == 0.0
    assert cost.decode_step_ms == pytest.approx(10.0, rel=0.1)
    assert cost.prefill_ms_per_token == pytest.approx(0.05, rel=0.05)


def test_the_engines_warm_up_steps_do_not_count() -> None:
    # Its first prefill and decode took seconds (a real engine's first steps warm it up).
    fit = StepCostFit()
    fit.observe(100, 0, 5000.0)
    fit.observe(0, 1, 2000.0)
    run(fit, 60, (6.0, 0.07, 9.0, 0.5), seed=4)
    cost = fit.estimate()
    assert cost is not None
    assert cost.prefill_ms_per_token == pytest.approx(0.07, rel=0.1)
    assert cost.prefill_step_ms < 12 and cost.decode_step_ms < 12


def test_it_follows_the_hardware_when_steps_get_slower() -> None:
    fit = StepCostFit(window_steps=100)
    run(fit, 300, (6.0, 0.07, 9.0, 0.5), seed=2)
    run(fit, 1000, (12.0, 0.14, 18.0, 1.0), seed=3)
    cost = fit.estimate()
    assert cost is not None
    assert cost.prefill_ms_per_token == pytest.approx(0.14, rel=0.05)
