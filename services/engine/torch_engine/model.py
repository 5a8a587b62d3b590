"""A decoder-only transformer with the Llama layout, loaded from a Hugging Face checkpoint folder.

The math follows Hugging Face's ``LlamaForCausalLM`` (RMSNorm in float32, rotate-half rotary
embeddings, grouped-query attention, SwiGLU MLP) so its checkpoints load by parameter name and give
the same logits. Attention is passed in: the engine attends over its paged cache, tests and
``forward_full`` over the whole sequence.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A ``rope_scaling`` (or v5 ``rope_parameters``) entry; ``linear`` and ``llama3`` only."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Read a ``config.json`` as transformers v4 or v5 writes it (defaults are HF's)."""
        model_type = raw.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"model_type {model_type!r} is not the Llama layout")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("Llama checkpoints with projection biases are not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads do not split into {kv_heads} KV groups")
        # v5 folds rope_theta and rope_scaling into one rope_parameters entry.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=raw["vocab_size"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling(rope),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        return cls.from_dict(json.loads(path.read_text()))


def _rope_scaling(rope: dict[str, Any]) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    raise ValueError(f"rope type {rope_type!r} is not supported")


def rope_inv_freq(config: LlamaConfig, device: torch.device) -> Tensor:
    """Rotary frequencies per pair of dimensions, in float32, with the checkpoint's scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by ``factor``, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    config: LlamaConfig, positions: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Cosines and sines [tokens, head_dim] for ``apply_rope``; the sines' first half is negated,
    which is the sign rotate-half gives the dimensions it brings from the second half."""
    freqs = positions.float()[:, None] * rope_inv_freq(config, positions.device)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    sin = angles.sin()
    sin[:, : freqs.shape[1]].neg_()
    return angles.cos().to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` is [tokens, heads, head_dim]; Llama rotates the two halves, not interleaved pairs.
    Rolling by half swaps them; ``sin`` carries the sign."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend ``q`` [tokens, heads, head_dim] over the context that ``k`` and ``v``
        [tokens, kv_heads, head_dim] (rotated, of the same tokens) extend; [tokens, heads, dim]."""
        ...


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, past: int, mask: Tensor | None = None
) -> Tensor:
    """One sequence: ``q`` holds its tokens at positions ``past ..``; ``k`` and ``v`` its whole
    context from position 0. Each query sees the keys up to its own position. ``mask`` is that
    [queries, keys] rule, for callers that build it once for many calls."""
    n = q.shape[0]
    if past and n > 1 and mask is None:
        key_pos = torch.arange(past + n, device=q.device)
        mask = key_pos <= torch.arange(past, past + n, device=q.device)[:, None]
    # 4-D, a batch of one: SDPA's fused CPU kernel takes only 4-D inputs, 3-D ones go to the
    # math fallback, which materialises every score.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        # Without a past, queries and keys are the same tokens: SDPA's own causal mask fits.
        is_causal=not past,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _full_causal(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return causal_attention(q, k, v, past=0)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # In float32 whatever the weights' dtype, as HF does, so half-precision runs agree with it.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` that, once packed, multiplies by a copy of its weight laid out
    for oneDNN, as ``torch.compile`` does for CPU inference: at the engine's batch sizes that is
    about a third faster than ``F.linear``, at the cost of holding the weight twice."""

    packed: Tensor | None = None

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return out

    def pack(self) -> None:
        """Packs a copy: call it once the weight is final and on the CPU."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        dim, heads = config.head_dim, config.num_attention_heads
        kv_heads = config.num_key_value_heads
        self.q_proj = Linear(config.hidden_size, heads * dim)
        self.k_proj = Linear(config.hidden_size, kv_heads * dim)
        self.v_proj = Linear(config.hidden_size, kv_heads * dim)
        self.o_proj = Linear(heads * dim, config.hidden_size)
        self.layer = layer
        self.shape = (heads, kv_heads, dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        heads, kv_heads, dim = self.shape
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, heads, dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(n, kv_heads, dim), cos, sin)
        v = self.v_proj(x).view(n, kv_heads, dim)
        out: Tensor = self.o_proj(attention(self.layer, q, k, v).reshape(n, heads * dim))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        # In place: both products are fresh, and a long prefill's are large.
        gated = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        out: Tensor = self.down_proj(gated)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaBackbone(nn.Module):
    """What HF calls ``model``: the parameter names below it are ``model.*``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)

    def forward(self, token_ids: Tensor, positions: Tensor, attention: Attention) -> Tensor:
        """Final hidden states [tokens, hidden] of a flat batch of tokens at ``positions``; which
        sequence each token belongs to is ``attention``'s business."""
        x = self.model.embed_tokens(token_ids)
        cos, sin = rope_cos_sin(self.config, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        out: Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits: Tensor = self.lm_head(hidden)
        return logits.float()

    @torch.inference_mode()
    def forward_full(self, token_ids: Tensor) -> Tensor:
        """Logits [tokens, vocab] of one sequence, recomputed from scratch with no cache."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden: Tensor = self(token_ids, positions, _full_causal)
        return self.compute_logits(hidden)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Build the model from ``config.json`` and every ``*.safetensors`` file in ``model_dir``."""
    config = LlamaConfig.from_file(model_dir / "config.json")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, Tensor] = {}
    for path in files:
        state.update(load_file(path, device=str(device)))
    # Old checkpoints carry the rotary frequencies as a buffer; they are recomputed from config.
    state = {
        name: tensor.to(dtype)
        for name, tensor in state.items()
        if not name.endswith("rotary_emb.inv_freq")
    }
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Built on the meta device so no memory is spent on weights about to be replaced.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match the Llama layout: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    # What torch.backends.mkldnn.is_available() returns, typed: some builds lack oneDNN.
    if device.type == "cpu" and dtype == torch.float32 and torch._C._has_mkldnn:
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack()
    return model.eval()
