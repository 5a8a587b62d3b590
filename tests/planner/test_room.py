"""Routing only to workers with a free slot while any has one."""

from __future__ import annotations

from services.planner.policy import WorkerView
from services.planner.routable import with_room


def view(worker_id: str, in_flight: int, running: int = 0) -> WorkerView:
    return WorkerView(worker_id, running=running, waiting=0, kv_usage=0.0, in_flight=in_flight)


def test_full_workers_are_left_out_while_another_has_a_slot() -> None:
    views = [view("a", 2), view("b", 1), view("c", 3)]
    assert [v.worker_id for v in with_room(views, {"a": 2, "b": 2, "c": 4})] == ["b", "c"]


def test_a_stale_report_of_a_full_batch_does_not_hide_a_free_worker() -> None:
    # Its last report still shows two running; this planner saw both end.
    views = [view("a", 0, running=2), view("b", 2)]
    assert [v.worker_id for v in with_room(views, {"a": 2, "b": 2})] == ["a"]


def test_every_worker_when_none_has_room() -> None:
    views = [view("a", 2), view("b", 5)]
    assert with_room(views, {"a": 2, "b": 2}) == views
