"""Next-token choice per request: greedy at temperature 0, else temperature and nucleus (top-p)
sampling from the request's own seeded generator, so a fixed seed gives a fixed output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from schemas.events import SamplingParams


@dataclass(slots=True)
class RequestSampler:
    temperature: float
    top_p: float
    # On CPU whatever the model's device: the same seed then draws the same tokens everywhere.
    generator: torch.Generator

    @classmethod
    def create(cls, params: SamplingParams, seed: int) -> RequestSampler:
        generator = torch.Generator()
        generator.manual_seed(seed)
        return cls(params.temperature, params.top_p, generator)

    def draw(self, logits: Tensor) -> int:
        """A token from one row of float32 CPU logits."""
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p >= 1.0:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest head of the ranking whose mass reaches top_p: a token stays if the
        # mass ranked above it is still short of top_p, so the top token always stays.
        keep = (sorted_probs.cumsum(0) - sorted_probs) < self.top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=self.generator)
        return int(order[choice])


def sample(logits: Tensor, samplers: Sequence[RequestSampler]) -> list[int]:
    """One token per row of ``logits`` [requests, vocab], row ``i`` chosen by ``samplers[i]``."""
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, s in enumerate(samplers) if s.temperature > 0.0]
    if random_rows:
        rows = logits[random_rows].float().cpu()
        for row, i in zip(rows, random_rows, strict=True):
            tokens[i] = samplers[i].draw(row)
    return tokens
