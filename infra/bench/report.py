"""`laneway bench` reports side by side: a text table for the terminal and JSON for tooling."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MISSING = "-"


def _number(value: Any) -> float | None:
    # bool is an int subclass, but True is never a meaningful metric value here.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def metric(report: dict[str, Any], key: str, stat: str | None = None) -> float | None:
    """The number at ``report[key]`` (or ``report[key][stat]``); None when missing or NaN."""
    value = report.get(key)
    if stat is not None:
        value = value.get(stat) if isinstance(value, dict) else None
    return _number(value)


def _fmt(value: float | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return MISSING if value is None else f"{value * 100:.1f}%"


def _busy(report: dict[str, Any], pick: Callable[[list[float]], float]) -> str:
    busy = report.get("worker_busy_fraction")
    if not isinstance(busy, dict):
        return MISSING
    values = [n for n in map(_number, busy.values()) if n is not None]
    return f"{pick(values):.3f}" if values else MISSING


_Row = tuple[str, Callable[[dict[str, Any]], str]]


def _latency_row(name: str, key: str, stat: str) -> _Row:
    return f"{name} {stat} (ms)", lambda r: _fmt(metric(r, key, stat), ".2f")


def _rows() -> list[_Row]:
    rows: list[_Row] = [
        ("requests", lambda r: _fmt(metric(r, "requests"), ".0f")),
        ("completed", lambda r: _fmt(metric(r, "completed"), ".0f")),
        ("failed", lambda r: _fmt(metric(r, "failed"), ".0f")),
        ("prefix hit rate", lambda r: _percent(metric(r, "prefix_hit_rate"))),
    ]
    rows += [
        _latency_row(name, key, stat)
        for name, key in (
            ("TTFT", "ttft_ms"),
            ("ITL", "itl_ms"),
            ("TPOT", "tpot_ms"),
            ("E2E", "e2e_ms"),
        )
        for stat in ("mean", "p50", "p95", "p99")
    ]
    rows += [
        # Variances of fractions are tiny; fixed-point would print them all as 0.000.
        ("util variance", lambda r: _fmt(metric(r, "util_variance"), ".3e")),
        ("max worker busy", lambda r: _busy(r, max)),
        ("min worker busy", lambda r: _busy(r, min)),
        ("wall s", lambda r: _fmt(metric(r, "wall_s"), ".2f")),
    ]
    return rows


def format_table(reports: dict[str, dict[str, Any]]) -> str:
    """One column per policy, one row per metric; missing or NaN values print as "-"."""
    rows = _rows()
    names = list(reports)
    cells = [[cell(reports[name]) for name in names] for _, cell in rows]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, name in enumerate(names)]

    def line(label: str, values: list[str]) -> str:
        padded = (v.rjust(w) for v, w in zip(values, widths, strict=True))
        return "  ".join([label.ljust(label_width), *padded]).rstrip()

    header = line("metric", names)
    rule = "  ".join(["-" * label_width, *("-" * w for w in widths)])
    body = [line(label, values) for (label, _), values in zip(rows, cells, strict=True)]
    return "\n".join([header, rule, *body])


def _json_safe(value: Any) -> Any:
    # JSON has no NaN or infinity; the stdlib would write bare tokens most parsers reject.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, reports: dict[str, dict[str, Any]]) -> None:
    """Every report, keyed by policy name, with NaN (and infinity) written as null."""
    text = json.dumps(_json_safe(reports), indent=2, allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
