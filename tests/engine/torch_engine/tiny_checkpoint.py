"""A tiny random Llama checkpoint in Hugging Face's layout, for the torch engine's tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder``; ``overrides`` replace
    config entries. Weights are scaled so that logits are far apart: greedy choices then do not
    hinge on rounding."""
    config = {**TINY_CONFIG, **overrides}
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def linear(out_dim: int, in_dim: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=gen) * (gain / math.sqrt(in_dim))

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    state = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen),
        "model.norm.weight": norm(),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden, 2.0),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden, 2.0),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        }
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = linear(config["vocab_size"], hidden, 4.0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(folder / "model.safetensors"))
    return folder
