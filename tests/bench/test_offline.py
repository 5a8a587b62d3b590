from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from infra.bench.offline import OfflineReplay
from infra.bench.tiers import OutputLengthMode, TierSettings
from infra.bench.traces import load_trace
from services.engine.sim import SimConfig
from services.planner.kv_policy import KvSettings
from services.planner.policy_registry import make_policy

SMALL_ENGINE = SimConfig(block_size=64, num_gpu_blocks=2048)


def replay(path: Path, policy: str, workers: int = 2, **kwargs: object) -> dict[str, object]:
    trace = load_trace(path, **kwargs)  # type: ignore[arg-type]
    return OfflineReplay(trace, make_policy(policy, 3), workers, SMALL_ENGINE).run().report


def test_report_has_every_metric(small_trace: Path) -> None:
    report = replay(small_trace, "round_robin")
    assert report["requests"] == report["completed"] == 12
    assert report["failed"] == 0
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p95", "p99"}  # type: ignore[arg-type]
    assert report["worker_requests"] == {"w000": 6, "w001": 6}
    assert 0 < report["prefix_hit_rate"] < 1  # type: ignore[operator]
    assert report["util_variance"] >= 0  # type: ignore[operator]


@pytest.mark.parametrize("policy", ["round_robin", "random", "least_loaded"])
def test_offline_replay_is_deterministic(small_trace: Path, policy: str) -> None:
    a, b = replay(small_trace, policy), replay(small_trace, policy)
    a.pop("wall_s")
    b.pop("wall_s")
    assert a == b


def test_one_worker_gets_every_turn_cached(small_trace: Path) -> None:
    # With one worker every turn finds its history: the hit rate is the trace's best.
    one = replay(small_trace, "round_robin", workers=1)
    # Three conversations in turn over two workers: turns keep changing worker.
    many = replay(small_trace, "round_robin", workers=2)
    assert one["prefix_hit_rate"] > many["prefix_hit_rate"]  # type: ignore[operator]


def test_faster_arrivals_mean_more_queueing(small_trace: Path) -> None:
    calm = replay(small_trace, "round_robin", speedup=1)
    rush = replay(small_trace, "round_robin", speedup=50)
    assert rush["ttft_ms"]["p95"] > calm["ttft_ms"]["p95"]  # type: ignore[index]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("speedup", "dynamo"),
    [
        (1.0, {"ttft_p50": 184, "ttft_p95": 1022, "e2e_p95": 6602, "hit": 0.082}),
        (4.0, {"ttft_p50": 274, "ttft_p95": 1716, "e2e_p95": 23945, "hit": None}),
    ],
)
def test_round_robin_matches_dynamos_mocker(
    mooncake_trace: Path, speedup: float, dynamo: dict[str, float | None]
) -> None:
    trace = load_trace(mooncake_trace, speedup=speedup)
    report = OfflineReplay(trace, make_policy("round_robin"), 8, SimConfig()).run().report
    assert report["completed"] == 12031
    assert report["wall_s"] < 60
    for ours, theirs in (
        (report["ttft_ms"]["p50"], dynamo["ttft_p50"]),
        (report["ttft_ms"]["p95"], dynamo["ttft_p95"]),
        (report["e2e_ms"]["p95"], dynamo["e2e_p95"]),
    ):
        assert theirs is not None
        assert ours == pytest.approx(theirs, rel=0.2)
    if dynamo["hit"] is not None:
        assert report["prefix_hit_rate"] == pytest.approx(dynamo["hit"], abs=0.02)


@pytest.mark.parametrize(
    ("output_length", "host_ratio", "topology"),
    [("oracle", 0.0, None), ("predicted", 0.0, None), ("oracle", 2.0, (2, 2))],
)
def test_catching_up_gives_what_stepping_in_global_order_gives(
    tmp_path: Path,
    output_length: OutputLengthMode,
    host_ratio: float,
    topology: tuple[int, int] | None,
) -> None:
    # Conversations on busy workers with a small KV cache: runs meet evictions and preemptions,
    # and arrivals at equal times.
    rng = random.Random(5)
    histories: list[list[int]] = [[] for _ in range(30)]
    rows = []
    for n in range(400):
        ids = histories[rng.randrange(30)]
        ids += range(n * 10, n * 10 + rng.randint(1, 3))
        rows.append(
            {
                "timestamp": n * 40 - n % 3 * 40,
                "input_length": len(ids) * 512 - rng.randint(0, 500),
                "output_length": rng.randint(1, 400),
                "hash_ids": list(ids),
            }
        )
    path = tmp_path / "busy.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = load_trace(path)
    config = SimConfig(num_gpu_blocks=512, num_host_blocks=round(host_ratio * 512))
    tiers = TierSettings(host_ratio, topology=topology, output_length=output_length)
    kv = KvSettings(moves=topology is not None)
    _assert_catching_up_changes_nothing(
        lambda: OfflineReplay(trace, make_policy("kv", 0, kv), 4, config, tiers=tiers)
    )


def _assert_catching_up_changes_nothing(make: Callable[[], OfflineReplay]) -> None:
    """Replays made by ``make`` give the same figures, decisions and records stepping in one
    global order and catching up."""
    results = []
    for catch_up in (False, True):
        replay = make()
        replay.catch_up = catch_up
        replay.decisions = []
        results.append(replay.run())
    exact, caught_up = results
    exact.report.pop("wall_s")
    caught_up.report.pop("wall_s")
    assert caught_up.report == exact.report
    assert caught_up.decisions == exact.decisions
    assert [repr(r) for r in caught_up.records] == [repr(r) for r in exact.records]


def test_idle_workers_started_by_arrivals_at_one_time_learn_in_arrival_order(
    tmp_path: Path,
) -> None:
    """Two arrivals at one time on two idle workers, alike to the token, end together: the
    predictor learns from them in the order one global event order has (the first arrival's
    step's end was scheduled first). A Mooncake slice met this (`laneway bench
    --sample-conversations 40 --hash-id-tokens 32 --workers 2 --block-size 32`), and catching up
    stopped with an error."""
    rows = [
        {"timestamp": t, "input_length": 300, "output_length": 20, "hash_ids": [2 * n, 2 * n + 1]}
        for n, t in enumerate((0, 0, 5000, 5000, 5000))
    ]
    path = tmp_path / "together.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = load_trace(path)
    tiers = TierSettings(0.0, output_length="predicted")
    _assert_catching_up_changes_nothing(
        lambda: OfflineReplay(trace, make_policy("kv"), 2, SMALL_ENGINE, tiers=tiers)
    )


@pytest.mark.parametrize(
    ("busy_a", "busy_b", "a_first"),
    [
        # At equal ends, the step that started first ended first in a global order.
        ([(0.0, 1.0), (1.0, 2.0)], [(0.5, 2.0)], False),
        # Starts tie too: back along both workers' chains of steps.
        ([(0.0, 1.0), (1.0, 2.0)], [(0.2, 1.0), (1.0, 2.0)], True),
        # A start when idle follows an arrival, which comes before any step's end at its time.
        ([(0.0, 1.0), (1.0, 2.0)], [(0.5, 0.9), (1.0, 2.0)], False),
    ],
)
def test_lessons_at_one_time_go_in_the_order_their_steps_started(
    small_trace: Path,
    busy_a: list[tuple[float, float]],
    busy_b: list[tuple[float, float]],
    a_first: bool,
) -> None:
    replay = OfflineReplay(load_trace(small_trace), make_policy("kv"), 2, SMALL_ENGINE)
    for worker, busy in zip(replay._workers, (busy_a, busy_b), strict=True):
        for interval in busy:
            worker.record.busy.append(interval)
    a, b = (2.0, 0, len(busy_a) - 1, 0), (2.0, 1, len(busy_b) - 1, 1)
    assert replay._earlier(a, b) == (-1 if a_first else 1)
    assert replay._earlier(b, a) == (1 if a_first else -1)
