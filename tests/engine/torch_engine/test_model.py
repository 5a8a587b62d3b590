"""The Llama model: config parsing, loading by Hugging Face parameter names, and the reference
forward pass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.torch_engine.model import Linear, LlamaConfig, causal_attention, load_model

from .tiny_checkpoint import TINY_CONFIG, write_tiny_checkpoint

CPU = torch.device("cpu")


def test_config_reads_transformers_v4_and_v5_layouts() -> None:
    v4 = LlamaConfig.from_dict({**TINY_CONFIG, "rope_theta": 500000.0, "eos_token_id": [2, 7]})
    assert (v4.head_dim, v4.rope_theta, v4.eos_token_ids, v4.rope_scaling) == (
        16,
        500000.0,
        (2, 7),
        None,
    )
    raw = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    v5 = LlamaConfig.from_dict(
        {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}
    )
    assert v5.rope_theta == 123.0
    assert v5.rope_scaling is None
    llama3 = LlamaConfig.from_dict(
        {
            **TINY_CONFIG,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3.rope_scaling is not None
    assert llama3.rope_scaling.factor == 8.0
    assert llama3.rope_theta == 10000.0


@pytest.mark.parametrize(
    "change",
    [
        {"model_type": "qwen2"},
        {"attention_bias": True},
        {"hidden_act": "gelu"},
        {"num_key_value_heads": 3},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    ],
)
def test_config_rejects_what_the_model_does_not_implement(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LlamaConfig.from_dict({**TINY_CONFIG, **change})


def test_loads_hf_names_and_matches_checkpoint(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, CPU, torch.float32)
    checkpoint = load_file(tiny_model_dir / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert torch.equal(state[name], tensor), name


def test_tied_embeddings_share_the_embedding_matrix(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    model = load_model(folder, CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model.forward_full(torch.tensor([5, 6, 7]))
    assert logits.shape == (3, TINY_CONFIG["vocab_size"])


def test_a_missing_tensor_is_an_error(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_model(folder, CPU, torch.float32)


def test_a_folder_without_weights_is_an_error(tmp_path: Path) -> None:
    folder = write_tiny_checkpoint(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_model(folder, CPU, torch.float32)


def test_causal_attention_matches_explicit_softmax_with_grouped_heads() -> None:
    gen = torch.Generator().manual_seed(0)
    past, n, heads, kv_heads, dim = 3, 4, 6, 2, 8
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(past + n, kv_heads, dim, generator=gen)
    v = torch.randn(past + n, kv_heads, dim, generator=gen)
    out = causal_attention(q, k, v, past)
    group = heads // kv_heads
    for i in range(n):
        for h in range(heads):
            keys, values = k[: past + i + 1, h // group], v[: past + i + 1, h // group]
            weights = torch.softmax(keys @ q[i, h] / math.sqrt(dim), dim=0)
            torch.testing.assert_close(out[i, h], weights @ values)


def test_forward_full_is_causal(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, CPU, torch.float32)
    tokens = torch.tensor([10, 20, 30, 40, 50, 60])
    full = model.forward_full(tokens)
    prefix = model.forward_full(tokens[:4])
    torch.testing.assert_close(full[:4], prefix, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch._C._has_mkldnn, reason="needs oneDNN")
def test_packed_linears_match_plain_ones(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, CPU, torch.float32)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))
    packed = model.forward_full(tokens)
    for m in linears:
        m.packed = None
    torch.testing.assert_close(model.forward_full(tokens), packed, atol=1e-4, rtol=0)
