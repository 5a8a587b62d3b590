"""The modelled time of moving a prompt's KV between two workers: what the planner weighs when it
considers a remote prefill, and what a sim decode worker waits out for a hand-off (a real engine
waits for the real bytes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache


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


@lru_cache(maxsize=256)
def sized(link: KvTransferModel, kv_bytes_per_token: int) -> KvTransferModel:
    """``link`` carrying a model whose token's KV takes ``kv_bytes_per_token`` (0: unknown, the
    link's own size stands)."""
    if not kv_bytes_per_token or kv_bytes_per_token == link.kv_bytes_per_token:
        return link
    return replace(link, kv_bytes_per_token=kv_bytes_per_token)


# A PCIe transfer's fixed cost (DMA setup), far below a network link's.
PCIE_LATENCY_MS = 0.05


@dataclass(frozen=True, slots=True)
class LinkModel:
    """The link between two workers by where they are: GPUs of one node talk over NVLink, nodes
    of one rack and nodes across racks over RDMA networks (the defaults: 300 GB/s NVLink-class,
    50 and 25 GB/s RDMA-class). A worker whose node is unknown ('') is on a node of its own."""

    same_node: KvTransferModel = KvTransferModel(bandwidth_gb_s=300.0, latency_ms=0.05)
    same_rack: KvTransferModel = KvTransferModel(bandwidth_gb_s=50.0, latency_ms=0.5)
    across_racks: KvTransferModel = KvTransferModel(bandwidth_gb_s=25.0, latency_ms=1.0)

    def between(self, a: tuple[str, str], b: tuple[str, str]) -> KvTransferModel:
        """The link between workers placed at ``a`` and ``b``, each ``(node, rack)``."""
        if a[0] and a[0] == b[0]:
            return self.same_node
        if a[1] and a[1] == b[1]:
            return self.same_rack
        return self.across_racks
