from __future__ import annotations

import pytest

from services.engine.sim import (
    DynamoMockerPerf,
    FixedPerf,
    SimConfig,
    SimEngine,
    perf_model,
)

from ._sim_support import make_request


def test_dynamo_mocker_prefill_polynomial() -> None:
    perf = DynamoMockerPerf()
    assert perf.step_ms(1000, 0, 0.5) == pytest.approx(32.1058589)
    assert perf.step_ms(0, 0, 0.5) == 0.0


def test_dynamo_mocker_decode_polynomial_and_floor() -> None:
    perf = DynamoMockerPerf()
    assert perf.step_ms(0, 3, 0.5) == pytest.approx(26.31)
    assert perf.step_ms(0, 1, 0.0) == pytest.approx(5.74)
    # The polynomial goes below 1 ms only outside 0..1; the floor keeps steps apart in time.
    assert perf.step_ms(0, 1, -1.0) == 1.0


def test_dynamo_mocker_mixed_step_sums_prefill_and_decode() -> None:
    perf = DynamoMockerPerf()
    mixed = perf.step_ms(1000, 4, 0.5)
    assert mixed == pytest.approx(perf.step_ms(1000, 0, 0.5) + perf.step_ms(0, 4, 0.5))


def test_fixed_perf() -> None:
    perf = FixedPerf(prefill_ms_per_token=0.5, decode_ms_per_step=3.0)
    assert perf.step_ms(10, 0, 0.9) == 5.0
    assert perf.step_ms(10, 7, 0.9) == 8.0
    assert perf.step_ms(0, 0, 0.9) == 0.0


def test_perf_models_by_name() -> None:
    assert isinstance(perf_model("dynamo-mocker"), DynamoMockerPerf)
    assert perf_model("fixed") == FixedPerf(0.02, 5.0)
    with pytest.raises(ValueError, match="dynamo-mocker, fixed"):
        perf_model("gpu")


def test_engine_step_duration_follows_its_configured_perf_model() -> None:
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
