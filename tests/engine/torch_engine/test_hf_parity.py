"""The model against Hugging Face's own ``LlamaForCausalLM`` on the same checkpoint, when
transformers is installed (it is not a dependency of the project)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.torch_engine.model import load_model

from .tiny_checkpoint import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

# float32 throughout; with transformers 5.24 on CPU the measured difference is 0.
ATOL = 1e-4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0},
        {"num_key_value_heads": 1, "head_dim": 32},
    ],
    ids=["plain", "tied", "linear-rope", "llama3-rope", "mqa-wide-heads"],
)
def test_logits_match_transformers(tmp_path: Path, overrides: dict[str, Any]) -> None:
    folder = write_tiny_checkpoint(tmp_path, seed=3, **overrides)
    ours = load_model(folder, torch.device("cpu"), torch.float32)
    # The checkpoint is float32, so both load it as float32.
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager")
    theirs.eval()
    tokens = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = theirs(tokens[None]).logits[0]
    torch.testing.assert_close(ours.forward_full(tokens), expected, atol=ATOL, rtol=0)
