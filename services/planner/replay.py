"""Deciding a recorded request again: a ``RouteDecided`` event carries every input of its decision
and the policy's turn, so the current code can make the same decision from the event alone, and
say which of the recorded terms it no longer reproduces."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from schemas.events import PlannerConfigured, RouteCandidate, RouteDecided
from services.common.kv_transfer import KvTransferModel
from services.planner.cluster import decided_reason
from services.planner.decision import REBOUND, Decision, decide, inputs_of, rebind
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvSettings
from services.planner.policy import Policy
from services.planner.policy_registry import make_policy

_D = TypeVar("_D")

# Knobs recorded under an older name, and theirs now.
_RENAMED_KV = {"kv_moves": "moves"}


def configured(
    source: str,
    policy: str,
    seed: int,
    kv: KvSettings,
    disagg: DisaggSettings,
    version: str,
    speedup: float = 1.0,
) -> PlannerConfigured:
    """The record of a planner replica's settings, published when it starts."""
    return PlannerConfigured(
        source=source,
        policy=policy,
        seed=seed,
        kv=dataclasses.asdict(kv),
        disagg=dataclasses.asdict(disagg),
        version=version,
        speedup=speedup,
    )


def settings_of(config: PlannerConfigured) -> tuple[Policy, DisaggSettings]:
    """A fresh policy and the disaggregation settings of a recorded planner replica; settings
    this code no longer has are left out, ones it has since added take their defaults."""
    disagg = dict(config.disagg)
    transfer = _known(KvTransferModel, disagg.pop("transfer", {}))
    return (
        make_policy(config.policy, config.seed, _known(KvSettings, _renamed(config.kv))),
        dataclasses.replace(_known(DisaggSettings, disagg), transfer=transfer),
    )


def _renamed(knobs: dict[str, Any]) -> dict[str, Any]:
    return {_RENAMED_KV.get(k, k): v for k, v in knobs.items()}


def _known(kind: type[_D], values: dict[str, Any]) -> _D:
    names = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    return kind(**{k: v for k, v in values.items() if k in names})


def redecide(event: RouteDecided, policy: Policy, disagg: DisaggSettings) -> Decision:
    """The decision the current code makes from ``event``'s inputs, with the policy set to the
    turn the recorded decision saw; one another replica's session binding moved is moved alike."""
    policy.turn = event.policy_turn
    inputs = inputs_of(event)
    decision = decide(policy, disagg, inputs)
    rebound = decided_reason(event.reason, event.spec.attempt) == REBOUND
    if rebound and decision.worker_id != event.worker_id:
        # Another replica had bound the session first: the recorded worker is etcd's answer.
        return rebind(decision, inputs, event.worker_id)
    return decision


def differences(event: RouteDecided, decision: Decision) -> list[str]:
    """What ``decision`` does not reproduce of the recorded one, one line a term, as
    ``field: recorded -> now`` (candidates' terms as ``<worker>.<term>``); empty when identical."""

    def recorded_field(name: str) -> Any:
        if name == "reason":  # a migration's decision is recorded as one
            return decided_reason(event.reason, event.spec.attempt)
        return getattr(event, name)

    moved = [
        f"{name}: {recorded_field(name)!r} -> {value!r}"
        for name, value in decision.route_fields().items()
        if name not in ("candidates", "prefill") and recorded_field(name) != value
    ]
    moved += _candidate_terms("", event.candidates, decision.candidates)
    recorded, now = event.prefill, decision.prefill
    if (recorded is None) != (now is None):
        moved.append(f"prefill: {recorded!r} -> {now!r}")
    elif recorded is not None and now is not None:
        for name in ("prefill_worker_id", "local_ms", "remote_ms", "reason"):
            if getattr(recorded, name) != getattr(now, name):
                moved.append(
                    f"prefill.{name}: {getattr(recorded, name)!r} -> {getattr(now, name)!r}"
                )
        moved += _candidate_terms("prefill.", recorded.candidates, now.candidates)
    return moved


def _candidate_terms(
    prefix: str, recorded: tuple[RouteCandidate, ...], now: tuple[RouteCandidate, ...]
) -> list[str]:
    before = {c.worker_id: c.model_dump() for c in recorded}
    after = {c.worker_id: c.model_dump() for c in now}
    moved = (
        [f"{prefix}candidates: {sorted(before)} -> {sorted(after)}"]
        if before.keys() != after.keys()
        else []
    )
    for worker_id in sorted(before.keys() & after.keys()):
        old: dict[str, Any] = before[worker_id]
        new: dict[str, Any] = after[worker_id]
        moved += [
            f"{prefix}{worker_id}.{term}: {old[term]!r} -> {new[term]!r}"
            for term in old
            if old[term] != new[term]
        ]
    return moved
