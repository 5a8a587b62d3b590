"""The bench's text table, JSON and PNG, from report dicts built the way a replay builds them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from infra.bench.metrics import RequestRecord, WorkerRecord, build_report, busy_timeline
from infra.bench.plot import plot_reports
from infra.bench.report import format_table, write_json

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _token(record: RequestRecord, at: float) -> None:
    record.times.came(at)
    record.output_tokens += 1


def _report(workers: int, scale: float, timeline: bool = True) -> dict[str, Any]:
    """A small replay: ``scale`` stretches every latency, one request fails."""
    records = {f"w{i:03d}": WorkerRecord() for i in range(workers)}
    requests = []
    for i in range(6):
        worker_id = f"w{i % workers:03d}"
        arrival = 0.1 * i
        first = arrival + 0.02 * scale * (i + 1)
        record = RequestRecord(
            arrival, prompt_tokens=100, worker_id=worker_id, cached_tokens=25 * (i % 3)
        )
        for k in range(10):
            _token(record, first + 0.01 * scale * k)
        requests.append(record)
        records[worker_id].busy.append((arrival, record.times.last_s or first))
        records[worker_id].requests += 1
    requests.append(RequestRecord(0.7, prompt_tokens=50, worker_id="w000", failed=True))
    report = build_report(requests, records, wall_s=1.234)
    if timeline:
        report["busy_timeline"] = busy_timeline(records, report["duration_s"])
    return report


def _cells(table: str, label: str) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(label + "  "))
    return line[len(label) :].split()


def _ttft(report: dict[str, Any], n: int = 50) -> list[float]:
    # Spread around the report's mean so each CDF has a visible shape.
    mean = report["ttft_ms"]["mean"]
    return [mean * (0.5 + k / n) for k in range(n)]


def test_table_has_policies_and_formatted_numbers() -> None:
    reports = {"round_robin": _report(2, 1.0), "kv_aware": _report(3, 2.0)}
    table = format_table(reports)

    header = table.splitlines()[0].split()
    assert header[1:] == ["round_robin", "kv_aware"]
    assert _cells(table, "requests") == ["7", "7"]
    assert _cells(table, "completed") == ["6", "6"]
    assert _cells(table, "failed") == ["1", "1"]
    # 150 of the 600 prompt tokens of the completed requests were cached.
    assert _cells(table, "prefix hit rate") == ["25.0%", "25.0%"]
    # TTFTs are 20, 40, ... 120 ms (doubled for the second policy).
    assert _cells(table, "TTFT mean (ms)") == ["70.00", "140.00"]
    assert _cells(table, "TTFT p50 (ms)") == ["70.00", "140.00"]
    assert _cells(table, "TTFT p95 (ms)") == ["115.00", "230.00"]
    assert _cells(table, "ITL mean (ms)") == ["10.00", "20.00"]
    assert _cells(table, "E2E p99 (ms)") == ["209.00", "418.00"]
    rr = reports["round_robin"]
    assert _cells(table, "util variance")[0] == f"{rr['util_variance']:.3e}"
    busy = rr["worker_busy_fraction"].values()
    assert _cells(table, "max worker busy")[0] == f"{max(busy):.3f}"
    assert _cells(table, "min worker busy")[0] == f"{min(busy):.3f}"
    assert _cells(table, "wall s") == ["1.23", "1.23"]


def test_table_rows_in_order_and_aligned() -> None:
    table = format_table({"a": _report(2, 1.0), "a_much_longer_policy_name": _report(2, 1.0)})
    lines = table.splitlines()
    labels = [ln.split("  ")[0] for ln in lines[2:]]
    assert labels == [
        "requests",
        "completed",
        "failed",
        "prefix hit rate",
        *(
            f"{m} {s} (ms)"
            for m in ("TTFT", "ITL", "TPOT", "E2E")
            for s in ("mean", "p50", "p95", "p99")
        ),
        "util variance",
        "max worker busy",
        "min worker busy",
        "wall s",
    ]
    # Right-aligned columns: every row ends at the same column.
    assert len({len(ln) for ln in lines}) == 1


def test_table_prints_missing_and_nan_as_dash() -> None:
    # No request completed: every latency summary is NaN.
    empty = build_report([RequestRecord(0.0, 10, failed=True)], {"w0": WorkerRecord()}, 0.5)
    sparse = {"requests": 3, "ttft_ms": {"mean": 12.5}, "worker_busy_fraction": {}}
    table = format_table({"empty": empty, "sparse": sparse})

    assert _cells(table, "TTFT mean (ms)") == ["-", "12.50"]
    assert _cells(table, "TTFT p99 (ms)") == ["-", "-"]
    assert _cells(table, "E2E p50 (ms)") == ["-", "-"]
    assert _cells(table, "requests") == ["1", "3"]
    assert _cells(table, "completed") == ["0", "-"]
    assert _cells(table, "min worker busy") == ["0.000", "-"]
    assert _cells(table, "wall s") == ["0.50", "-"]
    assert "nan" not in table.lower()


def test_json_round_trips_with_nan_as_null(tmp_path: Path) -> None:
    report = _report(2, 1.0)
    report["ttft_ms"]["p99"] = math.nan
    report["future_key"] = {"nested": [1.5, math.nan]}
    path = tmp_path / "reports.json"
    write_json(path, {"round_robin": report, "other": {"requests": 0}})

    text = path.read_text()
    assert "NaN" not in text
    loaded = json.loads(text)
    assert list(loaded) == ["round_robin", "other"]
    back = loaded["round_robin"]
    assert set(back) == set(report)
    assert back["ttft_ms"]["p99"] is None
    assert back["ttft_ms"]["mean"] == pytest.approx(report["ttft_ms"]["mean"])
    assert back["future_key"] == {"nested": [1.5, None]}
    assert back["busy_timeline"] == report["busy_timeline"]
    assert back["worker_requests"] == report["worker_requests"]
    assert loaded["other"] == {"requests": 0}


@pytest.mark.parametrize(
    "reports",
    [
        pytest.param({"kv_aware": _report(4, 1.0)}, id="one-policy-timeline"),
        pytest.param({"kv_aware": _report(4, 1.0, timeline=False)}, id="one-policy-bars"),
        pytest.param(
            {
                "round_robin": _report(64, 2.0),
                "least_loaded": _report(8, 1.5, timeline=False),
                "kv_aware": _report(8, 1.0),
            },
            id="three-policies-mixed",
        ),
    ],
)
def test_plot_writes_png(tmp_path: Path, reports: dict[str, dict[str, Any]]) -> None:
    path = tmp_path / "bench.png"
    plot_reports(path, reports, {p: _ttft(r) for p, r in reports.items()}, "bench test")

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000


def test_plot_tolerates_missing_samples_and_nan(tmp_path: Path) -> None:
    empty = build_report([RequestRecord(0.0, 10, failed=True)], {"w0": WorkerRecord()}, 0.5)
    path = tmp_path / "bench.png"
    plot_reports(path, {"empty": empty, "ok": _report(2, 1.0)}, {"empty": []}, "sparse")

    assert path.read_bytes().startswith(PNG_MAGIC)


def test_itl_pools_every_gap_and_tpot_averages_per_request() -> None:
    """A 101-token answer with one 500 ms stall and a 3-token answer at 10 ms a token: per
    request, TPOT is 14.9 and 10 ms; pooled, 101 of the 102 gaps are 10 ms."""
    long, short = RequestRecord(0.0, 10), RequestRecord(0.0, 10)
    now = 1.0
    _token(long, now)
    for i in range(100):
        now += 0.5 if i == 0 else 0.01
        _token(long, now)
    for t in (1.0, 1.01, 1.02):
        _token(short, t)
    report = build_report([long, short], {"w0": WorkerRecord()}, 0.1)
    assert long.output_tokens == 101 and len(long.times.gaps_ms) == 100
    assert report["tpot_ms"]["p50"] == pytest.approx((14.9 + 10) / 2)
    assert report["itl_ms"]["p50"] == pytest.approx(10.0)
    assert report["itl_ms"]["p99"] == pytest.approx(10.0)
    assert report["itl_ms"]["mean"] == pytest.approx((500 + 101 * 10) / 102)
