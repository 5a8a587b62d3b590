"""One PNG comparing `laneway bench` policies: headline bars, TTFT CDFs, per-worker busy maps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Figure and the Agg canvas directly, not pyplot: no GUI backend, no global figure state.
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.ticker import LogFormatter

from infra.bench.report import MISSING, metric

# Label at most this many workers on an axis; 64 labels would overlap.
_MAX_WORKER_LABELS = 16

# (title, value of a report, label printed on its bar)
_HEADLINE: list[tuple[str, Callable[[dict[str, Any]], float | None], str]] = [
    ("prefix-cache hit rate (%)", lambda r: _scaled(metric(r, "prefix_hit_rate"), 100), ".1f"),
    ("mean TTFT (ms)", lambda r: metric(r, "ttft_ms", "mean"), ".1f"),
    # Variances of busy fractions are tiny; fixed-point labels would all read 0.0.
    ("utilisation variance across workers", lambda r: metric(r, "util_variance"), ".2e"),
    ("P95 end-to-end latency (ms)", lambda r: metric(r, "e2e_ms", "p95"), ".1f"),
]


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _color(i: int) -> str:
    # The same colour for a policy in every panel.
    return f"C{i}"


def _bars(
    ax: Axes,
    names: list[str],
    values: list[float | None],
    spec: str,
    title: str,
) -> None:
    heights = [v or 0.0 for v in values]
    bars = ax.bar(names, heights, color=[_color(i) for i in range(len(names))])
    labels = [MISSING if v is None else format(v, spec) for v in values]
    ax.bar_label(bars, labels=labels, padding=2, fontsize=9)
    top = max(heights)
    # Headroom so the labels on the tallest bar stay inside the axes.
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    # At least three bar slots, so one or two policies get bars as narrow as four do.
    slots = max(len(names), 3)
    middle = (len(names) - 1) / 2
    ax.set_xlim(middle - slots / 2, middle + slots / 2)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=9, labelrotation=20 if len(names) > 2 else 0)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def _ttft_cdf(ax: Axes, names: list[str], ttft_samples: dict[str, list[float]]) -> None:
    plotted = False
    for i, name in enumerate(names):
        # A log axis cannot show zero or negative times.
        samples = sorted(v for v in ttft_samples.get(name, []) if math.isfinite(v) and v > 0)
        if not samples:
            continue
        fractions = [(k + 1) / len(samples) for k in range(len(samples))]
        ax.step(samples, fractions, where="post", color=_color(i), label=name)
        plotted = True
    if plotted:
        ax.set_xscale("log")
        # Plain numbers ("40", "200") read faster than the default 4×10¹ on a latency axis.
        ax.xaxis.set_major_formatter(LogFormatter())
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no TTFT samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF", fontsize=11)
    ax.grid(alpha=0.3, which="both")


def _label_step(count: int) -> int:
    return max(1, math.ceil(count / _MAX_WORKER_LABELS))


def _heatmap(ax: Axes, report: dict[str, Any], timeline: dict[str, list[float]]) -> AxesImage:
    workers = list(timeline)
    duration = metric(report, "duration_s")
    windows = len(timeline[workers[0]])
    right, xlabel = (duration, "time (s)") if duration else (windows, "time window")
    image = ax.imshow(
        [timeline[w] for w in workers],
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        vmin=0.0,
        vmax=1.0,
        # Top-to-bottom rows in worker order, columns spanning the replay.
        extent=(0.0, right, len(workers) - 0.5, -0.5),
    )
    step = _label_step(len(workers))
    ax.set_yticks(range(0, len(workers), step), workers[::step], fontsize=7)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    return image


def _busy_bars(ax: Axes, busy: dict[str, Any], color: str) -> None:
    workers = list(busy)
    ax.bar(range(len(workers)), [metric(busy, w) or 0.0 for w in workers], color=color)
    step = _label_step(len(workers))
    ax.set_xticks(range(0, len(workers), step), workers[::step], fontsize=7, rotation=90)
    ax.set_ylim(0, 1)
    ax.set_ylabel("busy fraction (whole replay)", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def _busy_row(fig: Figure, axes: Sequence[Axes], reports: dict[str, dict[str, Any]]) -> None:
    image: AxesImage | None = None
    heat_axes = []
    for i, (ax, (name, report)) in enumerate(zip(axes, reports.items(), strict=True)):
        ax.set_title(f"{name}: worker busy fraction", fontsize=10)
        timeline = report.get("busy_timeline")
        busy = report.get("worker_busy_fraction")
        if isinstance(timeline, dict) and timeline:
            image = _heatmap(ax, report, timeline)
            heat_axes.append(ax)
        elif isinstance(busy, dict) and busy:
            _busy_bars(ax, busy, _color(i))
        else:
            ax.text(0.5, 0.5, "no worker data", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
    if image is not None:
        # Every heatmap shares vmin/vmax, so one colour bar reads for all of them.
        fig.colorbar(image, ax=heat_axes, label="busy fraction", shrink=0.9)


def plot_reports(
    path: Path,
    reports: dict[str, dict[str, Any]],
    ttft_samples: dict[str, list[float]],
    title: str,
) -> None:
    """Write a PNG comparing ``reports`` (1 to 4 policies, keyed by policy name) to ``path``.

    ``ttft_samples[policy]`` holds that policy's per-request TTFTs in ms, for the CDF.
    """
    if not reports:
        raise ValueError("no reports to plot")
    names = list(reports)
    scaled = {n: r["roles_timeline"] for n, r in reports.items() if r.get("roles_timeline")}
    fig = Figure(figsize=(16, 15 if scaled else 12), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=14)
    heights = [1, 1, 1.2, 0.8] if scaled else [1, 1, 1.2]
    rows = fig.add_gridspec(len(heights), 1, height_ratios=heights)

    headline_axes = rows[0].subgridspec(1, len(_HEADLINE)).subplots(squeeze=False)[0]
    for ax, (metric_title, value, spec) in zip(headline_axes, _HEADLINE, strict=True):
        _bars(ax, names, [value(reports[n]) for n in names], spec, metric_title)

    _ttft_cdf(fig.add_subplot(rows[1]), names, ttft_samples)

    busy_axes = rows[2].subgridspec(1, len(names)).subplots(squeeze=False)[0]
    _busy_row(fig, busy_axes, reports)
    if scaled:
        _roles(fig.add_subplot(rows[3]), scaled)

    fig.savefig(path, format="png")


def _roles(ax: Axes, timelines: dict[str, list[dict[str, Any]]]) -> None:
    """The capacity loop's trajectory: prefill workers over time, per policy."""
    for i, (name, timeline) in enumerate(timelines.items()):
        times = [step["t"] for step in timeline]
        ax.step(
            times,
            [step["prefill"] for step in timeline],
            where="post",
            color=_color(i),
            label=f"{name}: prefill workers",
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("prefill workers")
    ax.set_title("role timeline (capacity loop)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
