"""Settings of one TensorRT-LLM engine, and the error it raises."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TrtllmEngineConfig:
    model_dir: Path
    # Tokens per KV block (TensorRT-LLM's tokens_per_block); the engine's own report wins.
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Longest prompt plus completion; None: the model's max_position_embeddings.
    max_seq_len: int | None = None
    # KV cache size in tokens; None: ``free_gpu_memory_fraction`` of the memory left after the
    # weights. TensorRT-LLM versions that cannot report the pool's size need it set.
    kv_cache_max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    kv_events: bool = True
    event_buffer_max_size: int = 16384
    # None: the model directory's end-of-sequence token.
    eos_token_id: int | None = None
    # How long a step waits for output when none is ready: short enough not to stall the
    # worker's event loop, long enough not to spin.
    poll_wait_s: float = 0.002
    # How long steps go on after the last request ends, to collect its trailing KV events.
    linger_s: float = 1.0


class TrtllmError(RuntimeError):
    """TensorRT-LLM failed a request (``request_id`` set) or the engine itself."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
