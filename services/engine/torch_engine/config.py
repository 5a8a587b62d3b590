"""Settings of one torch engine; the scheduling ones are named as vLLM (and ``sim``) name them."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.torch_engine.model import DTYPES


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    block_size: int = 16
    num_gpu_blocks: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    device: str = "cpu"
    # One of model.DTYPES: "float32", "bfloat16", "float16".
    dtype: str = "float32"
    # Mixed into the sampling seed of requests that bring none.
    seed: int = 0
    # Host-memory KV tier, in blocks (0: none): evicted blocks are copied to CPU tensors and
    # loaded back for a prompt that continues into them, instead of being recomputed.
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
