"""A sim engine taking a request whose KV another worker sends (a KV move): the blocks are cached
and the step that first schedules the request waits out the transfer."""

from __future__ import annotations

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
