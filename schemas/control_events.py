"""The control plane's events: each worker's load and measured step costs, the capacity loop's
looks and moves between the pools, and each planner replica's settings."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from schemas.envelope import Envelope, Frozen, Role

# A LoRA adapter's name, as loaded through the API (services.ingress.adapters).
LoraName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class StepCost(Frozen):
    """A worker's engine step times as it measured them on its own hardware: a step that
    prefills costs ``prefill_step_ms`` plus ``prefill_ms_per_token`` a prompt token computed,
    one that decodes ``decode_step_ms`` plus ``decode_ms_per_seq`` a sequence. The planner
    predicts with it instead of its perf model, which is a guess at hardware it has not seen."""

    prefill_step_ms: float = Field(ge=0.0)
    prefill_ms_per_token: float = Field(ge=0.0)
    decode_step_ms: float = Field(ge=0.0)
    decode_ms_per_seq: float = Field(ge=0.0)


class WorkerLoadReported(Envelope):
    """A worker's load, reported periodically and on change."""

    type: Literal["WorkerLoadReported"] = "WorkerLoadReported"
    worker_id: str
    role: Role
    running: int = Field(ge=0, description="requests being generated")
    waiting: int = Field(ge=0, description="requests queued, not yet scheduled")
    waiting_prefill_tokens: int = Field(ge=0, description="prompt tokens queued for prefill")
    kv_blocks_used: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    busy_s: float = Field(
        default=0.0, ge=0.0, description="seconds spent in engine steps since the worker started"
    )
    step_cost: StepCost | None = Field(
        default=None,
        description="its steps' times as measured (engines on real hardware, once measured)",
    )
    loras: tuple[LoraName, ...] = Field(
        default=(),
        max_length=1024,
        description="the LoRA adapters resident in its engine, least recently used first",
    )


class RoleMove(Frozen):
    """One worker moved from one pool to the other."""

    worker_id: str
    from_role: Role
    to_role: Role


class RolesRebalanced(Envelope):
    """The capacity planner moved workers between the prefill and decode pools."""

    type: Literal["RolesRebalanced"] = "RolesRebalanced"
    moves: tuple[RoleMove, ...]
    reason: str


class CapacityReviewed(Envelope):
    """The capacity loop's look at one interval of one pool of workers: what it saw, what it did,
    and which targets no move between the prefill and decode pools can meet now."""

    type: Literal["CapacityReviewed"] = "CapacityReviewed"
    model: str | None = Field(
        default=None, max_length=256, description="the model pool looked at; None: all workers"
    )
    ttft_p95_ms: float | None = Field(ge=0.0, description="over the interval; None: none ended")
    itl_p95_ms: float | None = Field(ge=0.0, description="over the interval's token gaps")
    ttft_target_ms: float = Field(gt=0.0, description="the TTFT p95 it keeps to")
    itl_target_ms: float = Field(gt=0.0, description="the ITL p95 it keeps to")
    prefill_workers: int = Field(ge=0, description="in the prefill pool when it looked")
    decode_workers: int = Field(ge=0, description="serving decode (aggregated: all) when it looked")
    moved: int = Field(default=0, ge=0, description="workers it moved (RolesRebalanced says whom)")
    reason: str = Field(max_length=1024)
    out_of_reach: tuple[Literal["ttft", "itl"], ...] = Field(
        default=(),
        max_length=2,
        description="targets missed that no move can meet: more workers, or faster, are needed",
    )


class PlannerConfigured(Envelope):
    """A planner replica started with these settings: with a ``RouteDecided`` from it (same
    ``source``), what it takes to make that decision again."""

    type: Literal["PlannerConfigured"] = "PlannerConfigured"
    policy: str = Field(description="routing policy")
    seed: int = Field(description="seed of the policy's random draws")
    kv: dict[str, Any] = Field(description="the kv policy's settings, by name")
    disagg: dict[str, Any] = Field(description="the disaggregation settings, by name")
    version: str = Field(description="Laneway version that decided")
    speedup: float = Field(
        default=1.0,
        gt=0,
        description="how many times faster than their perf model the sim workers ran "
        "(`laneway bench --time-scale`): the log's latencies are that much shorter",
    )
