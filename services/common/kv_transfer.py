"""The modelled time of moving a prompt's KV between two workers: what the planner weighs when it
considers a remote prefill, and what a sim decode worker waits out for a hand-off (a real engine
waits for the real bytes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvTransferModel:
    """Time to move KV from a prefill to a decode worker. The default shape is a Llama-3-8B-like
    model in bf16 (32 layers × 8 KV heads × 128 dims × K and V × 2 bytes = 128 KiB a token)
    over a 25 GB/s link with 1 ms of fixed latency."""

    kv_bytes_per_token: int = 131_072
    bandwidth_gb_s: float = 25.0
    latency_ms: float = 1.0

    def transfer_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_ms + tokens * self.kv_bytes_per_token / (self.bandwidth_gb_s * 1e6)
