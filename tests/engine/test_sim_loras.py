"""The sim's LoRA adapters: a request of an adapter not resident costs the step that first
schedules it the adapter's load, a resident one nothing; at most ``max_loras`` stay resident,
the least recently used going first."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.engine.sim import FixedPerf, SimConfig, SimEngine
from tests.engine._sim_support import make_request, run_to_end

LOAD_MS = 150.0


def engine(max_loras: int = 2) -> SimEngine:
    config = SimConfig(
        block_size=4,
        num_gpu_blocks=64,
        max_num_batched_tokens=64,
        perf_model="fixed",
        max_loras=max_loras,
        lora_load_ms=LOAD_MS,
    )
    return SimEngine(config, FixedPerf())


def served_ms(sim: SimEngine, request_id: str, lora: str | None, prompt: int = 1) -> float:
    """Milliseconds the engine takes to serve one 2-token request alone."""
    sim.add_request(replace(make_request(request_id, [prompt] * 8, max_tokens=2), lora=lora))
    return sum(result.duration_s for result in run_to_end(sim)) * 1000


def test_a_load_is_paid_once_while_the_adapter_stays_resident() -> None:
    sim = engine()
    base = served_ms(sim, "base", None)
    assert served_ms(sim, "a1", "a", prompt=2) == pytest.approx(base + LOAD_MS)
    assert served_ms(sim, "a2", "a", prompt=3) == pytest.approx(base)
    assert sim.held_loras == ("a",)


def test_the_least_recently_used_adapter_goes_beyond_max_loras() -> None:
    sim = engine(max_loras=2)
    base = served_ms(sim, "base", None)
    for i, lora in enumerate("abab"):
        served_ms(sim, f"warm-{i}", lora, prompt=10 + i)
    assert sim.held_loras == ("a", "b")  # least recently used first
    # c evicts a (b was used last), so a loads again; b is still resident.
    assert served_ms(sim, "c", "c", prompt=20) == pytest.approx(base + LOAD_MS)
    assert sim.held_loras == ("b", "c")
    assert served_ms(sim, "b-again", "b", prompt=21) == pytest.approx(base)
    assert served_ms(sim, "a-again", "a", prompt=22) == pytest.approx(base + LOAD_MS)


def test_a_step_pays_each_new_adapter_it_schedules() -> None:
    sim = engine(max_loras=4)
    for i, lora in enumerate("xy"):
        sim.add_request(replace(make_request(f"r{i}", [30 + i] * 8, max_tokens=1), lora=lora))
    assert sim.coming_loras == ("x", "y")
    first = sim.step()
    assert first.duration_s * 1000 >= 2 * LOAD_MS
    assert sim.held_loras == ("x", "y") and sim.coming_loras == ()


def test_max_loras_may_not_be_negative_and_zero_refuses_adapters() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        SimConfig(max_loras=-1)
    sim = engine(max_loras=0)
    with pytest.raises(ValueError, match="holds no adapters"):
        sim.add_request(replace(make_request("r", [1] * 8, max_tokens=1), lora="a"))
