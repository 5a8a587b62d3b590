"""Conditional disaggregation: prefill a prompt on a prefill worker and hand its KV to the decode
worker only when that pays, per request.

Local prefill costs the decode worker's queue plus the prompt's uncached part there, and stalls
every request decoding there while it runs. Remote prefill costs the best prefill worker's queue
and prefill, plus moving the KV to the decode worker. The cheaper wins; short uncached parts stay
local whatever the costs say, since a hand-off has fixed overheads the model does not capture.

The request pays for its own hand-off too: its first token leaves the prefill worker, its second
comes only after the KV has crossed the link, and inter-token latency spreads that gap over the
tokens it generates. A short answer behind a long transfer would see its ITL dominated by it, so
such a request prefills locally when the stall that imposes on the decode worker is bounded.

The stall is worth sparing only while the request still gets its first token in time: a remote
prefill predicted past the TTFT target stays local when local is predicted sooner, so a backed-up
prefill pool never makes first tokens later than aggregated serving would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.common.kv_transfer import KvTransferModel, sized
from services.planner.kv_policy import KvAware
from services.planner.policy import RouteRequest, WorkerView

DisaggMode = Literal["never", "always", "auto"]


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    mode: DisaggMode = "auto"
    # Uncached prompt tokens below which prefill always stays on the decode worker.
    min_remote_tokens: int = 1024
    transfer: KvTransferModel = field(default_factory=KvTransferModel)
    # A hand-off adding more than this to each of the request's inter-token gaps (transfer time
    # over its tokens after the first) keeps prefill local, if the uncached part is at most
    # `max_local_stall_tokens`: beyond that the stall on the decode worker's running requests
    # costs them more than the transfer costs this one. 0 turns the rule off.
    max_handoff_ms_per_token: float = 3.0
    max_local_stall_tokens: int = 8192
    # A prompt whose remote prefill is predicted to miss this TTFT (ms) stays local when local
    # is predicted sooner: the stall a remote prefill spares the decode worker is not worth a
    # first token late past the target. 0 turns the rule off.
    ttft_target_ms: float = 0.0


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
    link = handoff_link(policy, settings, best, decode)
    remote_ms = remote.cost + link.transfer_ms(uncached)
    if settings.mode == "always":
        return PrefillPlan(best.worker_id, local_ms, remote_ms, "static disaggregation")
    if uncached < settings.min_remote_tokens:
        return PrefillPlan(None, local_ms, remote_ms, f"only {uncached} uncached tokens")
    per_token = handoff_ms_per_token(link, uncached, request.output_tokens)
    if (
        settings.max_handoff_ms_per_token > 0
        and per_token > settings.max_handoff_ms_per_token
        and uncached <= settings.max_local_stall_tokens
    ):
        return PrefillPlan(
            None, local_ms, remote_ms, f"hand-off adds {per_token:.1f} ms to each of its tokens"
        )
    # Costs count the stall each side's decodes suffer; first tokens come from the rest.
    remote_ttft = remote.queue_ms + remote.prefill_ms + link.transfer_ms(uncached)
    local_ttft = local.queue_ms + local.prefill_ms
    if 0 < settings.ttft_target_ms < remote_ttft and local_ttft < remote_ttft:
        return PrefillPlan(
            None, local_ms, remote_ms, f"remote first token {remote_ttft:.0f} ms, past target"
        )
    if remote_ms < local_ms:
        return PrefillPlan(
            best.worker_id, local_ms, remote_ms, f"remote {remote_ms:.0f} < local {local_ms:.0f} ms"
        )
    return PrefillPlan(
        None, local_ms, remote_ms, f"local {local_ms:.0f} <= remote {remote_ms:.0f} ms"
    )


def handoff_link(
    policy: KvAware, settings: DisaggSettings, a: WorkerView, b: WorkerView
) -> KvTransferModel:
    """The link a hand-off between ``a`` and ``b`` crosses: the topology's when both say where
    they are, else the one configured link; carrying the KV size the workers declare."""
    link = settings.transfer
    if a.node and b.node:
        link = policy.links.between((a.node, a.rack), (b.node, b.rack))
    return sized(link, b.kv_bytes_per_token or a.kv_bytes_per_token)


def handoff_ms_per_token(transfer: KvTransferModel, uncached: int, max_tokens: int) -> float:
    """What a hand-off of ``uncached`` tokens adds to a request's mean inter-token latency: the
    transfer delays its second token, and the mean is over its ``max_tokens - 1`` gaps."""
    return transfer.transfer_ms(uncached) / max(1, max_tokens - 1)


def pick_decoder(
    policy: KvAware,
    request: RouteRequest,
    decode: Sequence[WorkerView],
    settings: DisaggSettings,
    prefill: WorkerView | None = None,
) -> WorkerView:
    """The decode worker for a remotely prefilled request: where it will generate its tokens
    soonest. That is the decode step there once the request's KV is in (steps slow down as a
    worker's KV fills), plus its hand-off spread over its tokens (a worker caching more of the
    prompt needs less of it moved); prefill time no longer matters, the prompt is computed
    elsewhere."""

    def itl_ms(worker: WorkerView) -> float:
        uncached = request.prompt_tokens - worker.cached_blocks * worker.block_size
        output = request.output_tokens
        step = policy.decode_step_ms(worker, request.prompt_tokens + output)
        link = (
            sized(settings.transfer, worker.kv_bytes_per_token)
            if prefill is None
            else handoff_link(policy, settings, prefill, worker)
        )
        return step + handoff_ms_per_token(link, uncached, output)

    return min(decode, key=lambda w: (itl_ms(w), w.load, w.worker_id))
