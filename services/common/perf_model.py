"""How long a step takes on the modelled hardware, from what the step computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from schemas.control_events import StepCost


class PerfModel(Protocol):
    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        """Milliseconds for a step that computes ``prefill_tokens`` uncached prompt tokens and one
        token for each of ``decode_seqs`` decoding requests, with ``kv_usage`` (0 to 1) of the KV
        cache's tokens held by running requests."""
        ...


@dataclass(frozen=True, slots=True)
class DynamoMockerPerf:
    """The polynomial perf model of Dynamo's mocker (``PerfModel::Polynomial``).

    Dynamo's vLLM mocker runs a pass as a prefill phase followed by a decode phase and ends the
    pass at ``start + prefill + decode`` (``execute_pass_internal``), so a mixed step costs the sum.
    Dynamo also charges the decode phase when the only token-emitting requests are ones whose
    prefill just finished; here a step that only prefills is charged prefill time alone.
    """

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        ms = 0.0
        if prefill_tokens > 0:
            t = float(prefill_tokens)
            ms += 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
        if decode_seqs > 0:
            p = kv_usage
            ms += max(1.0, -25.74 * p * p + 54.01 * p + 5.74)
        return ms


@dataclass(frozen=True, slots=True)
class FixedPerf:
    """Linear: a step that prefills costs a fixed part and a part per token, one that decodes a
    fixed part and a part per sequence. Its defaults (the ``fixed`` preset) are cheap, so live
    tests run many steps quickly; a worker's own measured step costs are one too
    (:class:`schemas.control_events.StepCost`)."""

    prefill_ms_per_token: float = 0.02
    decode_ms_per_step: float = 5.0
    prefill_step_ms: float = 0.0
    decode_ms_per_seq: float = 0.0

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        ms = 0.0
        if prefill_tokens > 0:
            ms += self.prefill_step_ms + prefill_tokens * self.prefill_ms_per_token
        if decode_seqs > 0:
            ms += self.decode_ms_per_step + decode_seqs * self.decode_ms_per_seq
        return ms


_PRESETS: dict[str, Callable[[], PerfModel]] = {
    "dynamo-mocker": DynamoMockerPerf,
    "fixed": FixedPerf,
}
# What `perf_model` accepts: the CLI offers these as choices.
PERF_MODEL_NAMES = tuple(_PRESETS)


def perf_model(name: str) -> PerfModel:
    try:
        factory = _PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(_PRESETS))
        raise ValueError(f"unknown perf model {name!r}; known: {known}") from None
    return factory()


@lru_cache(maxsize=1024)
def measured_perf(cost: StepCost) -> FixedPerf:
    """A worker's measured step costs as a perf model (one per distinct report, kept: every
    prediction for that worker asks for it)."""
    return FixedPerf(
        prefill_ms_per_token=cost.prefill_ms_per_token,
        decode_ms_per_step=cost.decode_step_ms,
        prefill_step_ms=cost.prefill_step_ms,
        decode_ms_per_seq=cost.decode_ms_per_seq,
    )
