"""The planner's Prometheus metrics, in a registry of its own (one per planner object)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from observability.drops import count_drops_in
from services.planner.cluster import ClusterView
from services.planner.decision import Decision

# A decision takes well under a millisecond without the overlap query, which is bounded by
# LANEWAY_OVERLAP_TIMEOUT_S (50 ms).
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


def reason_label(reason: str) -> str:
    """A decision's reason without its figures ("lowest predicted TTFT: 3 cached blocks, …" →
    "lowest predicted TTFT"): a label takes few values, or Prometheus drowns in series."""
    for mark in (":", "("):
        reason = reason.partition(mark)[0]
    return reason.strip()


class _Pools(Collector):
    """The registered workers by role and draining, counted when scraped (not on each change)."""

    def __init__(self, cluster: ClusterView) -> None:
        self._cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "laneway_planner_workers",
            "Registered workers by model, role (prefill, decode, both) and draining, as this "
            "planner sees them.",
            labels=["model", "role", "draining"],
        )
        workers = self._cluster.workers.values()
        tally = Tally((w.model, w.role, str(w.draining).lower()) for w in workers)
        for labels, count in sorted(tally.items()):
            family.add_metric(list(labels), count)
        yield family


class PlannerMetrics:
    def __init__(self, cluster: ClusterView) -> None:
        self.registry = CollectorRegistry()
        count_drops_in(self.registry)
        self._decisions = Counter(
            "laneway_planner_decisions",
            "Routing decisions by model, policy, reason (without its figures), where the prompt "
            "is prefilled (local: on the decode worker, remote: on a prefill worker) and its "
            "LoRA adapter (none, held: the worker held it, load: it loads it first).",
            ["model", "policy", "reason", "prefill", "adapter"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "laneway_planner_decision_seconds",
            "A request taken from the bus to its route published, overlap query included.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.overlap_seconds = Histogram(
            "laneway_planner_overlap_query_seconds",
            "Overlap queries to the kv-indexer, a turn's in one batch: asked to answered (or "
            "timed out).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.overlap_failures = Counter(
            "laneway_planner_overlap_query_failures",
            "Overlap queries unanswered in time: those requests were routed on load alone.",
            registry=self.registry,
        )
        self.overlap_answers = Counter(
            "laneway_planner_overlap_answers",
            "Overlap answers by where they came from: local (the planner's own fold of the KV "
            "stream, caught up) or indexer (asked of the kv-indexer).",
            ["source"],
            registry=self.registry,
        )
        self.session_claims = Counter(
            "laneway_planner_session_claims",
            "Session bindings by outcome: claimed (first turn), lost (another replica claimed it "
            "first), moved (a migration: the owner was too busy).",
            ["outcome"],
            registry=self.registry,
        )
        self.failures = Counter(
            "laneway_planner_request_failures",
            "Requests the planner failed, by code (no_worker, timeout, worker_lost).",
            ["code"],
            registry=self.registry,
        )
        self.capacity_moves = Counter(
            "laneway_planner_capacity_moves",
            "Workers the capacity loop moved, by the pool they joined.",
            ["to_role"],
            registry=self.registry,
        )
        self.migrations = Counter(
            "laneway_planner_migrations",
            "Requests routed again on another worker after theirs was lost, stalled or drained "
            "(decisions of an attempt after the first).",
            registry=self.registry,
        )
        self.capacity_out_of_reach = Gauge(
            "laneway_planner_capacity_out_of_reach",
            "1 while the capacity loop finds a target missed that no move between the pools can "
            "meet (more workers, or faster, are needed), by target and model pool ('' all "
            "workers); the loop's CapacityReviewed event says why.",
            ["target", "model"],
            registry=self.registry,
        )
        self.intake_left = Counter(
            "laneway_planner_intake_left",
            "Times this replica left the requests to the other replicas, its own coming late "
            "(services.planner.intake_gate).",
            registry=self.registry,
        )
        self.output_length_error = Histogram(
            "laneway_planner_output_length_error_tokens",
            "How far the output length a request was routed with was from what it generated "
            "(absolute, tokens), for the requests this replica routed with a predicted one.",
            buckets=(1, 4, 16, 64, 256, 1024, 4096),
            registry=self.registry,
        )
        self.registry.register(_Pools(cluster))

    def decided(self, decision: Decision, model: str) -> None:
        prefill = "local" if decision.prefill_worker_id is None else "remote"
        chosen = (c for c in decision.candidates if c.worker_id == decision.worker_id)
        resident = next((c.lora_resident for c in chosen), None)
        adapter = "none" if resident is None else "held" if resident else "load"
        reason = reason_label(decision.reason)
        self._decisions.labels(model, decision.policy, reason, prefill, adapter).inc()
