"""Tiny, seeded LoRA adapters in PEFT layout for the tiny checkpoint (:mod:`.tiny`).

Tests of adapter serving need real adapter directories (``adapter_config.json`` and
``adapter_model.safetensors``) that fit the tiny model, without downloading any. Every linear
layer of every decoder layer is adapted, and ``lora_B`` is random rather than PEFT's zeros, so
an adapter does change what the model generates; a seed fixes every byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# The projections PEFT names by their last component, all of them: q/k/v/o and the MLP's three.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# lora_B's spread, the tiny model's own: with alpha = 2 * rank the update is about a third of
# a projection's output, enough to change greedy tokens, not enough to drown the base model.
B_STD = 0.02


def make_tiny_lora(directory: Path, base_dir: Path, seed: int, rank: int = 8) -> None:
    """Write a rank-``rank`` LoRA adapter for the checkpoint in ``base_dir`` (as
    :func:`.tiny.make_tiny_model` writes it) into ``directory``. The same seed, rank and base
    config write the same files."""
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    hidden = int(config["hidden_size"])
    intermediate = int(config["intermediate_size"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    q_width = int(config["num_attention_heads"]) * head_dim
    kv_width = int(config["num_key_value_heads"]) * head_dim
    # (in_features, out_features) of each target, as the model's linear layers have them.
    sizes = {
        "self_attn.q_proj": (hidden, q_width),
        "self_attn.k_proj": (hidden, kv_width),
        "self_attn.v_proj": (hidden, kv_width),
        "self_attn.o_proj": (q_width, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    # One generator drawn in a fixed order: the same seed gives the same tensors on any machine.
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for i in range(int(config["num_hidden_layers"])):
        for module, (fan_in, fan_out) in sizes.items():
            prefix = f"base_model.model.model.layers.{i}.{module}"
            a_std = fan_in**-0.5
            a = torch.normal(0.0, a_std, (rank, fan_in), generator=generator)
            b = torch.normal(0.0, B_STD, (fan_out, rank), generator=generator)
            weights[f"{prefix}.lora_A.weight"] = a
            weights[f"{prefix}.lora_B.weight"] = b
    directory.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    text = json.dumps(adapter_config, indent=2, sort_keys=True) + "\n"
    (directory / "adapter_config.json").write_text(text, encoding="utf-8")
    save_file(weights, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
