"""The context limit that requests are checked against, learnt from the workers' records in
etcd: the smallest that a registered worker holds, so that whichever worker the planner picks
can hold any request the ingress takes."""

from __future__ import annotations

from schemas.messages import WorkerRegistration


class WorkerContextLimit:
    def __init__(self) -> None:
        # None until a worker registers one.
        self.tokens: int | None = None

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        limits = [w.max_model_len for w in workers.values() if w.max_model_len is not None]
        # Workers come and go (a restart): the last known limit stands while none is registered.
        if limits:
            self.tokens = min(limits)
