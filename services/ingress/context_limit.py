"""The context limit that requests are checked against, learnt from the workers' records in
etcd: per served model, the smallest that a registered worker of that model holds, so that
whichever of its workers the planner picks can hold any request the ingress takes."""

from __future__ import annotations

from schemas.messages import WorkerRegistration


class WorkerContextLimit:
    def __init__(self) -> None:
        # Per model, once a worker of it registers one.
        self._tokens: dict[str, int] = {}

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        limits: dict[str, int] = {}
        for worker in workers.values():
            if worker.max_model_len is not None:
                known = limits.get(worker.model, worker.max_model_len)
                limits[worker.model] = min(known, worker.max_model_len)
        # Workers come and go (a restart): a model's last known limit stands while none of its
        # workers is registered.
        self._tokens.update(limits)

    def tokens(self, model: str) -> int | None:
        """``model``'s limit; None until a worker of it registers one."""
        return self._tokens.get(model)
