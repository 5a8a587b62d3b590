"""Settings of one vLLM engine: what a worker passes through to vLLM's engine arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VllmEngineConfig:
    model_dir: Path
    # Tokens per KV block: vLLM's CPU attention takes multiples of 32.
    block_size: int = 32
    # Longest prompt plus completion; None: the model's.
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    dtype: str = "auto"
    # The KV cache's size, GiB (host memory on the CPU build); None: vLLM's own choice (on a GPU,
    # what ``gpu_memory_utilization`` leaves after the weights).
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    # LoRA adapters held at once (vLLM's --max-loras, with --enable-lora); 0: LoRA off.
    max_loras: int = 0
    # Any other engine argument of vLLM's (``EngineArgs``), by name: it wins over the above.
    extra_args: dict[str, Any] = field(default_factory=dict)
