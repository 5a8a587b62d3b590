from __future__ import annotations

import pytest

from services.engine.sim import (
    DynamoMockerTiming,
    FixedTiming,
    SimConfig,
    SimEngine,
    timing_preset,
)

from ._sim_support import make_request


def test_dynamo_mocker_prefill_polynomial() -> None:
    timing = DynamoMockerTiming()
    assert timing.step_ms(1000, 0, 0.5) == pytest.approx(32.1058589)
    assert timing.step_ms(0, 0, 0.5) == 0.0


def test_dynamo_mocker_decode_polynomial_and_floor() -> None:
    timing = DynamoMockerTiming()
    assert timing.step_ms(0, 3, 0.5) == pytest.approx(26.31)
    assert timing.step_ms(0, 1, 0.0) == pytest.approx(5.74)
    # The polynomial goes below 1 ms only outside 0..1; the floor keeps steps apart in time.
    assert timing.step_ms(0, 1, -1.0) == 1.0


def test_dynamo_mocker_mixed_step_sums_prefill_and_decode() -> None:
    timing = DynamoMockerTiming()
    mixed = timing.step_ms(1000, 4, 0.5)
    assert mixed == pytest.approx(timing.step_ms(1000, 0, 0.5) + timing.step_ms(0, 4, 0.5))


def test_fixed_timing() -> None:
    timing = FixedTiming(prefill_ms_per_token=0.5, decode_ms_per_step=3.0)
    assert timing.step_ms(10, 0, 0.9) == 5.0
    assert timing.step_ms(10, 7, 0.9) == 8.0
    assert timing.step_ms(0, 0, 0.9) == 0.0


def test_presets_by_name() -> None:
    assert isinstance(timing_preset("dynamo-mocker"), DynamoMockerTiming)
    assert timing_preset("fixed") == FixedTiming(0.02, 5.0)
    with pytest.raises(ValueError, match="dynamo-mocker, fixed"):
        timing_preset("gpu")


def test_engine_step_duration_follows_its_config_preset() -> None:
    engine = SimEngine(SimConfig(num_gpu_blocks=100))
    engine.add_request(make_request("r", range(1000), max_tokens=2))
    prefill = engine.step()
    assert prefill.prefill_tokens == 1000
    assert prefill.duration_s == pytest.approx(32.1058589e-3)
    decode = engine.step()
    # The decode step reads 16 blocks of 64 tokens (1001 tokens) out of 100 blocks.
    p = 0.16
    assert decode.prefill_tokens == 0
    assert decode.duration_s == pytest.approx((-25.74 * p * p + 54.01 * p + 5.74) / 1000)
