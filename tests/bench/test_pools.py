"""`laneway bench --pool NAME=N`: an offline replay of model pools. A request goes to its model's
workers only: the model its trace line names, else one drawn per conversation in proportion to
the pools' workers; the report gives each model's figures."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from infra.bench.offline import OfflineReplay
from infra.bench.trace_draws import with_models
from infra.bench.traces import conversation, load_trace
from infra.cli import main
from services.engine.sim import SimConfig
from services.planner.policy_registry import make_policy

POOLS = {"alpha": 3, "beta": 1}


def test_conversations_keep_a_model_drawn_by_pool_size(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    drawn = with_models(trace, POOLS)
    assert with_models(trace, POOLS) == drawn
    by_conversation: dict[tuple[int, ...], set[str | None]] = {}
    for r in drawn:
        by_conversation.setdefault(conversation(r), set()).add(r.model)
    assert all(len(models) == 1 for models in by_conversation.values())
    # A request that names its model keeps it; one no pool serves is refused.
    named = [replace(trace[0], model="beta"), *trace[1:]]
    assert with_models(named, POOLS)[0].model == "beta"
    with pytest.raises(ValueError, match="no --pool serves"):
        with_models([replace(trace[0], model="gamma")], POOLS)


def test_each_request_is_served_by_its_models_workers(mooncake_trace: Path) -> None:
    trace = with_models(load_trace(mooncake_trace, limit=600), POOLS)
    asked = Counter(r.model for r in trace)
    # Drawn per conversation, three to one by workers.
    assert 2.0 < asked["alpha"] / asked["beta"] < 4.5
    for policy in ("kv", "round_robin"):
        replay = OfflineReplay(trace, make_policy(policy), 4, SimConfig(), pools=POOLS)
        result = replay.run()
        models = {"w000": "alpha", "w001": "alpha", "w002": "alpha", "w003": "beta"}
        served = {
            (r.model, models[record.worker_id])
            for r, record in zip(trace, result.records, strict=True)
        }
        assert served == {("alpha", "alpha"), ("beta", "beta")}, policy
        report = result.report["models"]
        assert {m: report[m]["requests"] for m in POOLS} == dict(asked)
        assert all(report[m]["completed"] == report[m]["requests"] for m in POOLS)


def test_the_bench_command_reports_each_model(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "pools.json"
    argv = ["bench", "--trace", str(small_trace), "--policy", "kv", "--json", str(out)]
    assert main([*argv, "--pool", "alpha=2", "--pool", "beta=1"]) == 0
    report = json.loads(out.read_text())["kv"]
    assert set(report["models"]) <= set(POOLS) and report["failed"] == 0
    assert main([*argv, "--pool", "alpha=2", "--autoscale"]) == 2
    assert main([*argv, "--pool", "alpha=2", "--mode", "live"]) == 2
