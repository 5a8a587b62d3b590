"""The sim decode worker's side of a hand-off: a prompt whose KV arrived whole decodes at once."""

from __future__ import annotations

import pytest

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest
from services.engine.sim import FixedPerf, SimConfig, SimEngine

CONFIG = SimConfig(block_size=16, num_gpu_blocks=64)


def handed_off(prompt_tokens: int = 40, max_tokens: int = 3) -> EngineRequest:
    # The decode side's prompt: the original one and the first token the prefill worker sampled.
    prompt = list(range(1, prompt_tokens + 2))
    hashes = chain_block_hashes(prompt, CONFIG.block_size)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest("r", prompt, sampling, hashes)


def test_a_whole_hand_off_decodes_from_its_first_step() -> None:
    engine = SimEngine(CONFIG, FixedPerf())
    request = handed_off()
    engine.import_blocks(request.block_hashes)
    engine.add_handed_off(request, 40)
    assert engine.load().waiting_prefill_tokens == 0
    steps = []
    while engine.has_work():
        steps.append(engine.step())
    assert all(step.prefill_tokens == 0 for step in steps)
    assert [len(o.new_token_ids) for step in steps for o in step.outputs] == [1, 1, 1]
    assert steps[0].duration_s == pytest.approx(FixedPerf().decode_ms_per_step / 1000)
    assert engine.load().kv_blocks_used == 0


def test_a_hand_off_whose_blocks_are_gone_prefills_what_is_missing() -> None:
    engine = SimEngine(CONFIG, FixedPerf())
    engine.add_handed_off(handed_off(), 40)  # nothing imported: the blocks were evicted
    first = engine.step()
    assert first.prefill_tokens == 41  # the prompt and the first token, all recomputed
    outputs = [o for o in first.outputs]
    while engine.has_work():
        outputs += engine.step().outputs
    assert len(outputs) == 3
    assert engine.load().waiting_prefill_tokens == 0


def test_a_hand_off_needs_part_of_the_prompt_to_be_new() -> None:
    engine = SimEngine(CONFIG, FixedPerf())
    with pytest.raises(ValueError):
        engine.add_handed_off(handed_off(), 41)
