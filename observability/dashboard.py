"""The Grafana dashboard for a Laneway cluster, generated so that its queries are reviewed as
code: ``python -m observability.dashboard > deploy/grafana/laneway.json``.

The first row holds the seed's four figures (prefix hit rate, TTFT, utilisation variance across
workers, P95 end-to-end latency); then ITL, queue depth, pool sizes, and what explains them
(tokens/s, KV usage, decisions, the planner's and the indexer's latencies, hand-offs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

UID = "laneway-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
_WIDTH = 12
_HEIGHT = 8


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    # (PromQL, legend) per series.
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"


def _quantiles(metric: str, *qs: float) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{RATE})))", f"p{q * 100:g}")
        for q in qs
    )


PANELS = (
    Panel(
        "Prefix hit rate",
        "Share of completed requests' prompt tokens served from a KV cache (ingress usage).",
        (
            (
                f"sum(rate(laneway_ingress_cached_prompt_tokens_total{RATE})) / "
                f"sum(rate(laneway_ingress_prompt_tokens_total{RATE}))",
                "hit rate",
            ),
        ),
        "percentunit",
    ),
    Panel(
        "Time to first token",
        "Request received at the ingress to its first token.",
        _quantiles("laneway_ingress_ttft_seconds", 0.5, 0.95, 0.99),
        "s",
    ),
    Panel(
        "Utilisation variance across workers",
        "Variance across workers of the share of time each engine steps: near 0 when the "
        "planner spreads load evenly. Per worker beside it.",
        (
            (f"stdvar(rate(laneway_worker_busy_seconds_total{RATE}))", "variance"),
            (f"rate(laneway_worker_busy_seconds_total{RATE})", "{{instance}}"),
        ),
    ),
    Panel(
        "P95 end-to-end latency",
        "Request received to its last token, completed requests.",
        _quantiles("laneway_ingress_e2e_latency_seconds", 0.95),
        "s",
    ),
    Panel(
        "Inter-token latency",
        "Each completed request's mean gap between tokens.",
        _quantiles("laneway_ingress_itl_seconds", 0.5, 0.95, 0.99),
        "s",
    ),
    Panel(
        "Queue depth",
        "Requests waiting in each worker's engine, and running.",
        (
            ("laneway_worker_queue", "waiting {{instance}}"),
            ("laneway_worker_running", "running {{instance}}"),
        ),
    ),
    Panel(
        "Pool sizes",
        "Registered workers by role, as the planners see them (draining ones apart).",
        (("max by (role, draining) (laneway_planner_workers)", "{{role}} draining={{draining}}"),),
    ),
    Panel(
        "Tokens per second",
        "Tokens computed by the workers: prompt tokens prefilled, and generated.",
        ((f"sum by (kind) (rate(laneway_worker_tokens_total{RATE}))", "{{kind}}"),),
    ),
    Panel(
        "Requests by status",
        "Ingress requests per second by final status (499: the client went away), in flight.",
        (
            (f"sum by (status) (rate(laneway_ingress_requests_total{RATE}))", "{{status}}"),
            ("sum(laneway_ingress_requests_in_flight)", "in flight"),
        ),
        "reqps",
    ),
    Panel(
        "KV cache usage",
        "Share of each worker's KV blocks in use.",
        (("laneway_worker_kv_usage", "{{instance}}"),),
        "percentunit",
    ),
    Panel(
        "Routing decisions",
        "Decisions per second by policy, reason and where the prompt is prefilled.",
        (
            (
                f"sum by (policy, reason, prefill) (rate(laneway_planner_decisions_total{RATE}))",
                "{{policy}}: {{reason}} ({{prefill}})",
            ),
        ),
    ),
    Panel(
        "Planner latency",
        "A decision, overlap query included, and the overlap query alone (p95).",
        (
            (
                "histogram_quantile(0.95, sum by (le) "
                f"(rate(laneway_planner_decision_seconds_bucket{RATE})))",
                "decision p95",
            ),
            (
                "histogram_quantile(0.95, sum by (le) "
                f"(rate(laneway_planner_overlap_query_seconds_bucket{RATE})))",
                "overlap query p95",
            ),
        ),
        "s",
    ),
    Panel(
        "kv-indexer",
        "KV events folded per second, blocks indexed, and events behind the stream.",
        (
            (f"sum(rate(laneway_kv_indexer_events_total{RATE}))", "events/s"),
            ("max(laneway_kv_indexer_blocks)", "blocks"),
            ("max(laneway_kv_indexer_lag_events)", "lag"),
        ),
    ),
    Panel(
        "Sessions, hand-offs and capacity moves",
        "Session claims by outcome (moved: a migration), KV hand-offs by side and outcome, "
        "workers moved between pools.",
        (
            (
                f"sum by (outcome) (rate(laneway_planner_session_claims_total{RATE}))",
                "session {{outcome}}",
            ),
            (
                f"sum by (side, outcome) (rate(laneway_worker_handoffs_total{RATE}))",
                "hand-off {{side}} {{outcome}}",
            ),
            (
                f"sum by (to_role) (increase(laneway_planner_capacity_moves_total{RATE}))",
                "to {{to_role}}",
            ),
        ),
    ),
)


def _panel(index: int, panel: Panel) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {
            "h": _HEIGHT,
            "w": _WIDTH,
            "x": (index % 2) * _WIDTH,
            "y": (index // 2) * _HEIGHT,
        },
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "Laneway",
        "description": "A Laneway cluster: cache hits, latencies, balance and pools.",
        "tags": ["laneway"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(render(), end="")
