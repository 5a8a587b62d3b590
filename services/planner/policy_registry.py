"""Every routing policy by name, for the planner's settings and `laneway bench`."""

from __future__ import annotations

from services.planner.kv_policy import KvAware, KvSettings
from services.planner.policy import LeastLoaded, Policy, RandomChoice, RoundRobin

POLICY_NAMES = ("round_robin", "random", "least_loaded", "kv")


def make_policy(name: str, seed: int = 0, kv: KvSettings | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(seed)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "kv":
        return KvAware(kv, seed)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
