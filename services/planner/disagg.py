"""Conditional disaggregation: prefill a prompt on a prefill worker and hand its KV to the decode
worker only when that pays, per request.

Local prefill costs the decode worker's queue plus the prompt's uncached part there, and stalls
every request decoding there while it runs. Remote prefill costs the best prefill worker's queue
and prefill, plus moving the KV to the decode worker. The cheaper wins; short uncached parts stay
local whatever the costs say, since a hand-off has fixed overheads the model does not capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.engine.kv_transfer import KvTransferModel
from services.planner.kv_policy import KvAware
from services.planner.policy import RouteRequest, WorkerView

DisaggMode = Literal["never", "always", "auto"]


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    mode: DisaggMode = "auto"
    # Uncached prompt tokens below which prefill always stays on the decode worker.
    min_remote_tokens: int = 1024
    transfer: KvTransferModel = field(default_factory=KvTransferModel)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    # The prefill worker, or None to prefill on the decode worker.
    prefill_worker: str | None
    local_ms: float
    remote_ms: float | None
    reason: str


def plan_prefill(
    policy: KvAware,
    request: RouteRequest,
    decode: WorkerView,
    prefill: Sequence[WorkerView],
    settings: DisaggSettings,
) -> PrefillPlan:
    local = policy.predict(request, decode)
    local_ms = local.cost
    if settings.mode == "never" or not prefill:
        return PrefillPlan(None, local_ms, None, "aggregated")
    uncached = request.prompt_tokens - decode.cached_blocks * decode.block_size
    others = [w for w in prefill if w.worker_id != decode.worker_id]
    if not others:
        return PrefillPlan(None, local_ms, None, "no other worker to prefill on")
    best = min(others, key=lambda w: (policy.predict(request, w).cost, w.worker_id))
    remote = policy.predict(request, best)
    # The candidate's own cost counts the stall its decodes suffer, when it has any.
    remote_ms = remote.cost + settings.transfer.transfer_ms(uncached)
    if settings.mode == "always":
        return PrefillPlan(best.worker_id, local_ms, remote_ms, "static disaggregation")
    if uncached < settings.min_remote_tokens:
        return PrefillPlan(None, local_ms, remote_ms, f"only {uncached} uncached tokens")
    if remote_ms < local_ms:
        return PrefillPlan(
            best.worker_id, local_ms, remote_ms, f"remote {remote_ms:.0f} < local {local_ms:.0f} ms"
        )
    return PrefillPlan(
        None, local_ms, remote_ms, f"local {local_ms:.0f} <= remote {remote_ms:.0f} ms"
    )
