"""The checkpoint `laneway make-tiny-model` writes, loaded by Hugging Face `transformers` the
standard way, gives the torch engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.bench.engine_bench import hf_greedy
from schemas.events import SamplingParams
from services.common.hf_tokenizer import HfTokenizer
from services.engine.protocol import EngineRequest
from services.engine.torch_engine.config import TorchEngineConfig
from services.engine.torch_engine.engine import TorchEngine

NEW_TOKENS = 24


def test_greedy_tokens_equal_transformers_generate(made_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = HfTokenizer(made_model)
    prompts = [
        tokenizer.encode("The river runs past the old mill"),
        tokenizer.encode("Once upon a time, in a quiet town by the sea, there lived"),
    ]
    engine = TorchEngine(made_model, TorchEngineConfig())
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", prompt, greedy))
    ours: dict[str, list[int]] = {"r0": [], "r1": []}
    while engine.has_work():
        for output in engine.step().outputs:
            ours[output.request_id] += output.new_token_ids

    model = transformers.AutoModelForCausalLM.from_pretrained(made_model, local_files_only=True)
    model.eval()
    for i, prompt in enumerate(prompts):
        assert hf_greedy(model, [prompt], NEW_TOKENS)[0] == ours[f"r{i}"]
