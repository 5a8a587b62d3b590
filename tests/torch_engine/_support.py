"""Shared helpers of the torch engine's tests: building engines and requests, running them, and
the full-recompute greedy reference that every paged result is checked against."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest, RequestOutput, StepResult
from services.engine.torch_engine import LlamaForCausalLM, TorchEngine, TorchEngineConfig

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


def run_to_end(engine: TorchEngine, max_steps: int = 2_000) -> list[StepResult]:
    results: list[StepResult] = []
    while engine.has_work():
        assert len(results) < max_steps, "engine did not drain"
        results.append(engine.step())
    return results


def outputs_by_request(results: Iterable[StepResult]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for result in results:
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_by_request(results: Iterable[StepResult]) -> dict[str, list[int]]:
    return {
        rid: [t for out in outs for t in out.new_token_ids]
        for rid, outs in outputs_by_request(results).items()
    }


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
