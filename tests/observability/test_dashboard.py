"""The Grafana dashboard: the committed file is what the code generates, it has the shape Grafana
loads, and every query names only series the services export (from their metric definitions)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from observability.dashboard import DATASOURCE, PANELS, dashboard, render
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.metrics import IndexerMetrics
from services.ingress.metrics import IngressMetrics
from services.planner.cluster import ClusterView
from services.planner.metrics import PlannerMetrics
from services.worker.metrics import WorkerMetrics

COMMITTED = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "laneway.json"
SEED_FIGURES = (
    "Prefix hit rate",
    "Time to first token",
    "Utilisation variance across workers",
    "P95 end-to-end latency",
)
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def _series(registry: CollectorRegistry) -> set[str]:
    # By type, not from samples: a labelled metric has none until a label set is used.
    return {
        family.name + suffix for family in registry.collect() for suffix in _SUFFIXES[family.type]
    }


def exported() -> set[str]:
    index = PrefixIndex()
    registries = (
        IngressMetrics().registry,
        PlannerMetrics(ClusterView()).registry,
        IndexerMetrics(lambda: index).registry,
        WorkerMetrics(lambda: 0.0).registry,
    )
    return set().union(*(_series(r) for r in registries))


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == render(), (
        "regenerate: python -m observability.dashboard > deploy/grafana/laneway.json"
    )


def test_the_dashboard_is_grafana_json() -> None:
    board = json.loads(COMMITTED.read_text())
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in board, key
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["type"] == "timeseries" and panel["title"]
        assert panel["datasource"] == DATASOURCE
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] + grid["w"] <= 24
        assert (grid["x"], grid["y"]) not in cells, f"{panel['title']} overlaps another panel"
        cells.add((grid["x"], grid["y"]))
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["expr"] and target["datasource"] == DATASOURCE


def test_the_seed_figures_itl_queues_and_pools_are_there() -> None:
    titles = [panel["title"] for panel in dashboard()["panels"]]
    assert titles[:4] == list(SEED_FIGURES)  # the first row
    for title in ("Inter-token latency", "Queue depth", "Pool sizes"):
        assert title in titles


def test_every_query_names_only_exported_metrics() -> None:
    names = exported()
    for panel in PANELS:
        for expr, _ in panel.queries:
            used = set(re.findall(r"\blaneway_[a-z0-9_]+", expr))
            assert used, f"{panel.title}: {expr} names no Laneway metric"
            assert used <= names, f"{panel.title}: {sorted(used - names)} are not exported"
