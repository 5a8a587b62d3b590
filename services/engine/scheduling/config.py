"""Settings of one simulated engine, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimConfig:
    block_size: int = 64
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Name of a model in :func:`services.common.perf_model.perf_model`.
    perf_model: str = "dynamo-mocker"
    # Host-memory tier: blocks it holds (0: none), and the PCIe link a hit there loads over.
    num_host_blocks: int = 0
    host_link_gb_s: float = 25.0
    host_link_latency_ms: float = 0.05
    # KV bytes of one token (Llama-3-8B-like bf16), what a load from host memory moves.
    kv_bytes_per_token: int = 131_072
    # LoRA adapters resident at once (vLLM's --max-loras; least recently used out beyond; 0:
    # requests with an adapter refused), and what loading one that is not costs the step that
    # first schedules a request of it.
    max_loras: int = 2
    lora_load_ms: float = 150.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.num_host_blocks < 0 or self.host_link_gb_s <= 0:
            raise ValueError("num_host_blocks must be >= 0 and host_link_gb_s positive")
        if self.max_loras < 0 or self.lora_load_ms < 0:
            raise ValueError("max_loras and lora_load_ms must be >= 0")
