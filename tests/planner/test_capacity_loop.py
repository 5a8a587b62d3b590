"""The live capacity loop's bookkeeping, with in-memory stand-ins for etcd and the bus."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge

from bus.channels import Topic
from bus.topology import Subjects
from schemas.envelope import Envelope
from schemas.events import (
    CapacityReviewed,
    RequestFinished,
    Role,
    RolesRebalanced,
    Usage,
    WorkerLoadReported,
)
from schemas.latency import LatencyHistogram
from schemas.messages import WorkerRegistration
from services.common.liveness import QUIET_S
from services.planner.capacity import CapacityPlanner, CapacitySettings
from services.planner.capacity_loop import CapacityLoop
from services.planner.cluster import ClusterView
from tests.helpers import registration


class Leader:
    async def start_if_absent(self) -> bool:
        return True


def worker(worker_id: str, role: Role, draining: bool = False) -> WorkerRegistration:
    update = {"role": role, "kv_blocks_total": 1000, "max_num_seqs": 8, "kv_handoff": True}
    return registration(worker_id).model_copy(update={**update, "draining": draining})


def finished(
    ttft_ms: float,
    e2e_ms: float,
    tokens: int,
    prefill_worker_id: str | None = None,
    stalled_gaps: int = 0,
) -> RequestFinished:
    """A request whose tokens after the first came evenly spaced."""
    gaps = LatencyHistogram()
    for _ in range(tokens - 1):
        gaps.add((e2e_ms - ttft_ms) / (tokens - 1))
    return RequestFinished(
        source="t",
        request_id="r",
        worker_id="d1",
        finish_reason="length",
        usage=Usage(prompt_tokens=10, completion_tokens=tokens),
        ttft_ms=ttft_ms,
        e2e_ms=e2e_ms,
        token_gaps=gaps,
        prefill_worker_id=prefill_worker_id,
        stalled_gaps=stalled_gaps,
    )


def make_loop(
    workers: list[WorkerRegistration],
    clock: Callable[[], float] = time.monotonic,
    out_of_reach: Gauge | None = None,
    **settings: Any,
) -> tuple[CapacityLoop, ClusterView, dict[str, Role], list[Envelope]]:
    """The loop, its cluster, the roles it assigned, and the events it published (its moves
    and, after each look, its review)."""
    cluster = ClusterView(clock)
    cluster.set_workers({w.worker_id: w for w in workers})
    assigned: dict[str, Role] = {}
    published: list[Envelope] = []

    async def assign(roles: dict[str, Role]) -> None:
        assigned.update(roles)

    async def publish(subject: Topic[Envelope], event: Envelope) -> None:
        assert (
            subject.subject
            == {
                RolesRebalanced: Subjects.roles_rebalanced,
                CapacityReviewed: Subjects.capacity_reviewed,
            }[type(event)].subject
        )
        published.append(event)

    capacity = CapacityPlanner(CapacitySettings(**settings))
    loop = CapacityLoop(
        capacity,
        cluster,
        Leader(),
        assign,
        publish,
        "planner/t",
        out_of_reach=out_of_reach,  # type: ignore[arg-type]
    )
    return loop, cluster, assigned, published


def moves(published: list[Envelope]) -> list[Envelope]:
    return [e for e in published if isinstance(e, RolesRebalanced)]


async def test_slow_first_tokens_move_the_least_busy_decode_worker() -> None:
    pool = [worker("p1", "prefill"), worker("d1", "decode"), worker("d2", "decode")]
    loop, cluster, assigned, published = make_loop(pool, ttft_target_ms=100)
    cluster.report(
        WorkerLoadReported(
            source="t", worker_id="d1", role="decode", running=5, waiting=0,
            waiting_prefill_tokens=0, kv_blocks_used=1, kv_blocks_total=10,
        )
    )  # fmt: skip
    for _ in range(10):
        loop.on_finished(finished(ttft_ms=500, e2e_ms=900, tokens=21, prefill_worker_id="p1"))
    loop.on_finished(finished(ttft_ms=50, e2e_ms=450, tokens=21))
    observed = loop.observe()
    assert observed.ttft_p95_ms == 500
    assert (observed.remote_ttft_p95_ms, observed.local_ttft_p95_ms) == (500, 50)
    assert observed.itl_p95_ms == pytest.approx(20, rel=0.05)
    assert (observed.prefill_workers, observed.decode_workers) == (1, 2)
    event = await loop.step()
    assert event is not None and assigned == {"d2": "prefill"}
    assert [(m.worker_id, m.from_role, m.to_role) for m in event.moves] == [
        ("d2", "decode", "prefill")
    ]
    assert moves(published) == [event] and "TTFT" in event.reason


def load(worker_id: str, role: Role) -> WorkerLoadReported:
    return WorkerLoadReported(
        source="t", worker_id=worker_id, role=role, running=1, waiting=0,
        waiting_prefill_tokens=0, kv_blocks_used=1, kv_blocks_total=10,
    )  # fmt: skip


async def test_a_worker_gone_quiet_does_not_count_so_the_last_one_serving_stays() -> None:
    now = 0.0
    pool = [worker("p1", "prefill"), worker("d1", "decode"), worker("d2", "decode")]
    loop, cluster, assigned, _ = make_loop(pool, lambda: now, ttft_target_ms=100)
    now = QUIET_S + 1  # d1 was killed: its lease stands a while, but it says nothing
    cluster.report(load("p1", "prefill"))
    cluster.report(load("d2", "decode"))
    for _ in range(10):
        loop.on_finished(finished(ttft_ms=500, e2e_ms=900, tokens=21, prefill_worker_id="p1"))
    observed = loop.observe()
    assert (observed.prefill_workers, observed.decode_workers) == (1, 1)
    # Counted, d1 would have let the move take d2, the one worker still decoding.
    assert await loop.step() is None and not assigned
    cluster.report(load("d1", "decode"))  # it was only slow: it counts again
    event = await loop.step()
    assert event is not None and assigned == {"d1": "prefill"}


async def test_slow_tokens_move_a_prefill_worker_back_and_draining_ones_do_not_count() -> None:
    pool = [
        worker("p1", "prefill"),
        worker("p2", "prefill"),
        worker("p3", "prefill", draining=True),
        worker("d1", "decode"),
    ]
    loop, _, assigned, _ = make_loop(pool, itl_target_ms=10)
    loop.on_finished(finished(ttft_ms=10, e2e_ms=1010, tokens=11))  # ITL 100 ms
    assert loop.observe().prefill_workers == 2
    event = await loop.step()
    assert event is not None and assigned == {"p1": "decode"}


async def test_near_the_targets_nothing_moves() -> None:
    loop, _, assigned, published = make_loop([worker("p1", "prefill"), worker("d1", "decode")])
    loop.on_finished(finished(ttft_ms=950, e2e_ms=950 + 9 * 24, tokens=10))
    assert await loop.step() is None
    assert not assigned and not moves(published)


async def test_an_idle_interval_moves_nothing() -> None:
    loop, _, assigned, _ = make_loop([worker("p1", "prefill"), worker("d1", "decode")])
    assert loop.observe().ttft_p95_ms is None
    assert await loop.step() is None and not assigned


async def test_within_targets_a_prefill_worker_goes_back_to_decoding() -> None:
    loop, _, assigned, published = make_loop([worker("p1", "prefill"), worker("d1", "decode")])
    loop.on_finished(finished(ttft_ms=10, e2e_ms=100, tokens=10))
    event = await loop.step()
    assert event is not None and assigned == {"p1": "decode"}
    assert moves(published) == [event] and "within targets" in event.reason


async def test_each_look_is_reviewed_and_a_target_out_of_reach_is_a_gauge_too() -> None:
    gauge = Gauge("out_of_reach", "t", ["target", "model"], registry=CollectorRegistry())
    pool = [worker("a1", "both"), worker("a2", "both")]
    loop, _, assigned, published = make_loop(pool, out_of_reach=gauge, ttft_target_ms=100)
    # Aggregated, first tokens slow: every worker prefills already, no move can help.
    loop.on_finished(finished(ttft_ms=500, e2e_ms=600, tokens=10))
    assert await loop.step() is None and not assigned
    (review,) = published
    assert isinstance(review, CapacityReviewed) and review.out_of_reach == ("ttft",)
    assert (review.ttft_p95_ms, review.ttft_target_ms, review.moved) == (500, 100, 0)
    assert (review.prefill_workers, review.decode_workers) == (0, 2)
    assert "every worker prefills already" in review.reason
    assert gauge.labels("ttft", "")._value.get() == 1
    assert gauge.labels("itl", "")._value.get() == 0
    # Fast again: nothing out of reach, and the gauge says so.
    loop._finished.clear()
    loop.on_finished(finished(ttft_ms=50, e2e_ms=100, tokens=10))
    await loop.step()
    last = published[-1]
    assert isinstance(last, CapacityReviewed) and last.out_of_reach == ()
    assert gauge.labels("ttft", "")._value.get() == 0


async def test_an_aggregated_pool_with_slow_tokens_is_split() -> None:
    pool = [worker("a1", "both"), worker("a2", "both")]
    loop, _, assigned, _ = make_loop(pool, itl_target_ms=10)
    # 50 ms a token, and 4 of its 20 gaps waited on prefills.
    loop.on_finished(finished(ttft_ms=90, e2e_ms=1090, tokens=21, stalled_gaps=4))
    assert loop.observe().stalled_gap_share == pytest.approx(0.2)
    assert (loop.observe().prefill_workers, loop.observe().decode_workers) == (0, 2)
    event = await loop.step()
    assert event is not None and assigned == {"a1": "prefill"}
    assert event.moves[0].from_role == "both"


async def test_each_model_pool_is_planned_apart() -> None:
    alpha = [worker(w, "both").model_copy(update={"model": "alpha"}) for w in ("a1", "a2")]
    beta = [worker(w, "both").model_copy(update={"model": "beta"}) for w in ("b1", "b2")]
    loop, _, assigned, published = make_loop([*alpha, *beta], itl_target_ms=10)
    assert loop.models() == ["alpha", "beta"]
    # alpha's tokens are slow (its d1 stand-in is a1), beta's are on target.
    slow = finished(ttft_ms=90, e2e_ms=1090, tokens=21, stalled_gaps=4)
    loop.on_finished(slow.model_copy(update={"worker_id": "a1"}))
    loop.on_finished(
        finished(ttft_ms=20, e2e_ms=120, tokens=21).model_copy(update={"worker_id": "b1"})
    )
    assert (loop.observe("alpha").decode_workers, loop.observe("beta").decode_workers) == (2, 2)
    assert loop.observe("beta").itl_p95_ms == pytest.approx(5, rel=0.05)
    assert await loop.step("beta") is None
    event = await loop.step("alpha")
    # Split within alpha: none of beta's workers is taken for alpha's prefills.
    assert event is not None and assigned == {"a1": "prefill"}
    assert moves(published) == [event] and event.reason.startswith("alpha: ")
