"""Admission control per model pool: each model's requests are bounded by its own workers' room,
so a busy pool sheds its own requests while another's workers are idle, instead of queueing them
on its workers as if the whole cluster's room were theirs (docs/models.md).

Each pool is an :class:`~services.ingress.admission.Admission` of the same settings (a
``max_in_flight`` bounds each pool), fed its own workers and their load reports; the ingress's
admission gauges sum the pools.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.events import WorkerLoadReported
from schemas.messages import WorkerRegistration
from services.ingress.admission import Admission, AdmissionSettings, AdmissionTicket, Priority
from services.ingress.fair_share import Tenant
from services.ingress.metrics import IngressMetrics


class PooledAdmission:
    def __init__(self, metrics: IngressMetrics, pool: Callable[[], Admission]) -> None:
        """``pool``: makes a pool's Admission."""
        self._pool = pool
        # model → its pool; a model's pool is made when a worker serving it registers or a
        # request asks for it (the ingress has checked that it serves that name).
        self._pools: dict[str, Admission] = {}
        self._model_of: dict[str, str] = {}
        metrics.admission_capacity.set_function(
            lambda: sum(a.capacity or 0 for a in self._pools.values())
        )
        metrics.admission_in_cluster.set_function(lambda: self.in_cluster)
        metrics.admission_queue.set_function(lambda: self.queued)

    def _of(self, model: str) -> Admission:
        pool = self._pools.get(model)
        if pool is None:
            pool = self._pools[model] = self._pool()
        return pool

    @property
    def in_cluster(self) -> int:
        return sum(a.in_cluster for a in self._pools.values())

    @property
    def queued(self) -> int:
        return sum(a.queued for a in self._pools.values())

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        self._model_of = {w.worker_id: w.model for w in workers.values()}
        pools: dict[str, dict[str, WorkerRegistration]] = {}
        for worker_id, worker in workers.items():
            pools.setdefault(worker.model, {})[worker_id] = worker
        for model in pools.keys() | self._pools.keys():
            pool = self._of(model)
            await pool.on_workers(pools.get(model, {}))
            # Models come and go with the workers' records: a pool of none that holds and
            # queues nothing goes (made again by the next request for it).
            if model not in pools and pool.in_cluster == pool.queued == 0:
                del self._pools[model]

    async def on_load(self, report: WorkerLoadReported) -> None:
        model = self._model_of.get(report.worker_id)
        if model is not None:  # else not registered (yet): its next report counts
            await self._pools[model].on_load(report)

    async def admit(
        self, priority: Priority, model: str, tenant: Tenant = None, weight: float = 1.0
    ) -> AdmissionTicket:
        """Room for one request of ``model`` (of ``tenant``, whose share is ``weight``), at once
        or after a short wait; raises Overloaded (429) if its pool has none. Each pool shares
        its own room among the tenants asking for it."""
        return await self._of(model).admit(priority, tenant, weight)


def pooled(settings: AdmissionSettings, metrics: IngressMetrics) -> PooledAdmission:
    """Pools of ``settings``, each bounded by its workers alone (no liveness, no pressure)."""
    return PooledAdmission(metrics, lambda: Admission(settings, metrics))
