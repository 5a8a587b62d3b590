"""``make_tiny_model``: deterministic, standard Llama layout, loadable by transformers offline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.hf_tokenizer import HfTokenizer
from services.engine.torch_engine import tiny
from services.engine.torch_engine.tiny import make_tiny_model
from tests.engine.torch_engine._support import Message

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _expected_shapes() -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = tiny.HIDDEN_SIZE, tiny.INTERMEDIATE_SIZE, tiny.VOCAB_SIZE
    kv = tiny.NUM_KV_HEADS * tiny.HEAD_DIM
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(tiny.NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def test_same_seed_same_files_other_seed_other_weights(made_model: Path, tmp_path: Path) -> None:
    started = time.perf_counter()
    make_tiny_model(tmp_path / "again")
    assert time.perf_counter() - started < 5.0
    make_tiny_model(tmp_path / "other", seed=1)
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (made_model / name).read_bytes(), name
    first = load_file(made_model / "model.safetensors")
    again = load_file(tmp_path / "again" / "model.safetensors")
    other = load_file(tmp_path / "other" / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    # The tokenizer does not depend on the seed.
    tokenizer = (made_model / "tokenizer.json").read_bytes()
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == tokenizer


def test_weights_have_the_standard_names_shapes_and_init(made_model: Path) -> None:
    weights = load_file(made_model / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in weights.items()} == _expected_shapes()
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert 2_000_000 < sum(v.numel() for v in weights.values()) < 10_000_000
    assert torch.equal(weights["model.norm.weight"], torch.ones(tiny.HIDDEN_SIZE))
    assert abs(float(weights["model.embed_tokens.weight"].std()) - tiny.INIT_STD) < 1e-3


def test_config_and_tokenizer_agree(made_model: Path) -> None:
    config = json.loads((made_model / "config.json").read_text())
    tokenizer = HfTokenizer(made_model)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert tokenizer.vocab_size <= config["vocab_size"]
    # The trainer fills nearly the whole vocabulary with merges of the built-in text.
    assert tokenizer.vocab_size > 0.9 * config["vocab_size"]
    assert config["max_position_embeddings"] >= 2048


def test_transformers_loads_it_offline(made_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(made_model, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == sum(
        v.numel() for v in load_file(made_model / "model.safetensors").values()
    )
    hf = transformers.AutoTokenizer.from_pretrained(made_model, local_files_only=True)
    ours = HfTokenizer(made_model)
    for text in (
        "The ferry crossed the river.",
        "café 😀 日本語",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert hf.encode(text) == ours.encode(text)
        assert hf.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(
            ours.encode(text)
        )
    messages = [Message("system", "Be brief."), Message("user", "Hello?")]
    assert hf.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    ) == ours.apply_chat_template(messages)
    assert hf.eos_token_id == ours.eos_token_id
    ids = torch.tensor([ours.encode("The lane ran down to the river")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], tiny.VOCAB_SIZE)
    assert torch.isfinite(logits).all()
