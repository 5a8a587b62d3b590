"""A sim engine taking a request whose KV another worker sends (a KV move): the blocks are cached
and the step that first schedules the request waits out the transfer; the source sends what its
GPU and host tiers hold."""

from __future__ import annotations

import pytest

from schemas.block_hash import chain_block_hashes
from services.engine.sim import FixedPerf, SimConfig, SimEngine
from tests.engine._sim_support import make_engine, make_request, run_to_end


def test_the_moved_blocks_are_hits_and_their_transfer_is_waited_out_once() -> None:
    engine = make_engine()
    engine.add_moved(make_request("m", range(13), max_tokens=3), blocks=3, transfer_ms=40.0)
    steps = run_to_end(engine)
    assert steps[0].outputs[0].cached_tokens == 12
    assert steps[0].prefill_tokens == 1
    # FixedPerf: 0.02 ms a prefill token, 5 ms a step that decodes.
    assert abs(steps[0].duration_s * 1000 - (40.0 + 0.02)) < 1e-9
    assert [round(s.duration_s * 1000, 6) for s in steps[1:]] == [5.0, 5.0]


def test_a_move_source_exports_what_its_gpu_and_host_tiers_hold() -> None:
    config = SimConfig(block_size=4, num_gpu_blocks=6, num_host_blocks=16, perf_model="fixed")
    source = SimEngine(config, FixedPerf())
    first, other = list(range(1, 22)), list(range(100, 121))
    for request_id, prompt in (("a", first), ("b", other)):
        source.add_request(make_request(request_id, prompt, max_tokens=1))
        run_to_end(source)
    hashes = chain_block_hashes(first, 4)
    gpu, _ = source.cached_prefix(hashes)
    assert gpu < len(hashes)  # b's prompt pushed some of a's blocks out to the host tier
    assert source.export_prefix(hashes) == (len(hashes), b"")
    target = make_engine()
    assert target.import_prefix(hashes, b"") == len(hashes)
    target.add_request(make_request("moved", first, max_tokens=1))
    assert run_to_end(target)[0].prefill_tokens == 1


def test_a_live_move_imports_first_then_queues_and_waits_out_its_transfer_once() -> None:
    engine = make_engine()
    request = make_request("m", range(13), max_tokens=3)
    hashes = chain_block_hashes(list(range(13)), 4)
    assert engine.import_prefix(hashes, b"") == 3
    engine.expect_transfer("m", 40.0)
    engine.add_request(request)
    steps = run_to_end(engine)
    assert (steps[0].outputs[0].cached_tokens, steps[0].prefill_tokens) == (12, 1)
    assert abs(steps[0].duration_s * 1000 - (40.0 + 0.02)) < 1e-9
    assert [round(s.duration_s * 1000, 6) for s in steps[1:]] == [5.0, 5.0]


def test_a_refused_move_leaves_no_transfer_for_a_later_request_of_that_id() -> None:
    engine = make_engine(num_gpu_blocks=2)  # 8 tokens: a 13-token prompt never fits
    engine.expect_transfer("m", 40.0)
    with pytest.raises(ValueError):
        engine.add_request(make_request("m", range(13), max_tokens=3))
    engine.add_request(make_request("m", range(5), max_tokens=1))
    assert run_to_end(engine)[0].duration_s * 1000 < 40.0
