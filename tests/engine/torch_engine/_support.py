"""Shared helpers of the torch engine's tests: building engines and requests, running them, and
the full-recompute greedy reference that every paged result is checked against."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest
from services.engine.torch_engine import LlamaForCausalLM, TorchEngine, TorchEngineConfig
from tests.engine._sim_support import outputs_by_request as outputs_by_request
from tests.engine._sim_support import run_to_end as run_to_end
from tests.engine._sim_support import tokens_by_request as tokens_by_request

SMALL = {"block_size": 4, "num_gpu_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64}


def make_engine(model_dir: Path, **config: Any) -> TorchEngine:
    return TorchEngine(model_dir, TorchEngineConfig(**{**SMALL, **config}))


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    **sampling: Any,
) -> EngineRequest:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, **sampling
    )
    return EngineRequest(request_id, tuple(prompt), params)


def random_prompt(rng: torch.Generator, length: int, vocab: int = 300) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=rng).tolist()


def greedy_reference(
    model: LlamaForCausalLM, prompt: Sequence[int], max_tokens: int, stop: Iterable[int] = ()
) -> list[int]:
    """Greedy decoding that recomputes the whole sequence for every token: no cache at all."""
    stops = set(stop)
    sequence = list(prompt)
    output: list[int] = []
    while len(output) < max_tokens:
        logits = model.forward_full(torch.tensor(sequence))
        token = int(logits[-1].argmax())
        output.append(token)
        sequence.append(token)
        if token in stops:
            break
    return output


@dataclass(frozen=True)
class Message:
    """A chat message as the tokenizer's template reads it."""

    role: str
    content: str
