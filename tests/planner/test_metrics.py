"""The planner's metrics: a reason is a label without its figures, and the pools are counted from
the cluster view when scraped."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from schemas.events import RouteCandidate
from schemas.messages import WorkerRegistration
from services.planner.cluster import ClusterView
from services.planner.decision import Decision
from services.planner.metrics import PlannerMetrics, reason_label


def test_a_reason_loses_its_figures() -> None:
    assert reason_label("lowest predicted TTFT: 3 cached blocks, queue 12 ms") == (
        "lowest predicted TTFT"
    )
    assert reason_label("least loaded (2 requests + KV usage)") == "least loaded"
    assert reason_label("decodes here after a remote prefill (first pick: softmax: 1)") == (
        "decodes here after a remote prefill"
    )
    assert reason_label("next in rotation") == "next in rotation"


def _worker(worker_id: str, role: str, draining: bool = False) -> WorkerRegistration:
    return WorkerRegistration.model_validate(
        {
            "worker_id": worker_id,
            "role": role,
            "engine": "sim",
            "model": "laneway-sim",
            "block_size": 16,
            "kv_blocks_total": 64,
            "max_num_seqs": 8,
            "max_model_len": 1024,
            "draining": draining,
            "pid": 1,
        }
    )


def test_pools_are_counted_when_scraped() -> None:
    cluster = ClusterView()
    metrics = PlannerMetrics(cluster)
    cluster.set_workers(
        {
            "a": _worker("a", "prefill"),
            "b": _worker("b", "decode"),
            "c": _worker("c", "decode", draining=True),
        }
    )
    text = generate_latest(metrics.registry).decode()
    assert (
        'laneway_planner_workers{draining="false",model="laneway-sim",role="prefill"} 1.0' in text
    )
    assert 'laneway_planner_workers{draining="false",model="laneway-sim",role="decode"} 1.0' in text
    assert 'laneway_planner_workers{draining="true",model="laneway-sim",role="decode"} 1.0' in text


def test_decisions_are_counted_by_model_and_adapter() -> None:
    metrics = PlannerMetrics(ClusterView())
    held = RouteCandidate(
        worker_id="a", cached_blocks=0, running=0, waiting=0, kv_usage=0.0, cost=1.0,
        lora_resident=True,
    )  # fmt: skip
    decision = Decision("a", "kv", "lowest predicted TTFT: 1 ms", (held,), None, 0)
    metrics.decided(decision, "alpha")
    base = replace(decision, candidates=(held.model_copy(update={"lora_resident": None}),))
    metrics.decided(base, "beta")
    text = generate_latest(metrics.registry).decode()
    labels = 'policy="kv",prefill="local",reason="lowest predicted TTFT"'
    assert f'laneway_planner_decisions_total{{adapter="held",model="alpha",{labels}}} 1.0' in text
    assert f'laneway_planner_decisions_total{{adapter="none",model="beta",{labels}}} 1.0' in text
