"""Which workers a request may be routed to now: those with a free slot, while any has one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from services.planner.policy import WorkerView


def with_room(views: Sequence[WorkerView], max_num_seqs: Mapping[str, int]) -> list[WorkerView]:
    """The candidates that can start a request at once (fewer requests than their
    ``max_num_seqs``), or all of them when none can. A full worker would queue it behind a whole
    answer, which the policies' costs do not see (they weigh queued prompt tokens, not slots);
    the ingress's admission control bounds how many wait when every worker is full.

    Counted by what this planner routed there and has not seen end: exact for one planner, where
    the load reports lag by up to their interval (a worker that just went idle still reports
    its last batch). Beside other planner replicas it undercounts, and a full worker may be
    picked now and then; the ingress's bound still holds."""
    free = [v for v in views if v.in_flight < max_num_seqs[v.worker_id]]
    return free or list(views)
