"""Admission per model pool: each model's requests are bounded by its own workers' room and
load, so a full pool sheds its own requests while another pool still admits; the ingress's
gauges sum the pools."""

from __future__ import annotations

import pytest

from services.ingress.admission import Admission, AdmissionSettings
from services.ingress.errors import Overloaded
from services.ingress.metrics import IngressMetrics
from services.ingress.pool_admission import PooledAdmission
from tests.helpers import load_report, registration
from tests.ingress.helpers import Clock, sample


def _pools(metrics: IngressMetrics) -> PooledAdmission:
    """Pools that shed at once, on a clock that stands still."""
    settings, clock = AdmissionSettings(max_wait_s=0.0), Clock()
    return PooledAdmission(metrics, lambda: Admission(settings, metrics, clock))


def _worker(worker_id: str, model: str) -> dict[str, object]:
    return {worker_id: registration(worker_id).model_copy(update={"model": model})}


async def test_a_full_pool_sheds_its_own_while_another_admits() -> None:
    metrics = IngressMetrics()
    admission = _pools(metrics)
    # Two pools of one worker each, 4 requests a worker (its max_num_seqs).
    await admission.on_workers({**_worker("a1", "alpha"), **_worker("b1", "beta")})  # type: ignore[dict-item]
    assert sample(metrics, "laneway_ingress_admission_capacity") == 8
    alpha = [await admission.admit("normal", "alpha") for _ in range(4)]
    with pytest.raises(Overloaded):
        await admission.admit("normal", "alpha")
    beta = await admission.admit("normal", "beta")
    assert admission.in_cluster == sample(metrics, "laneway_ingress_admission_in_cluster") == 5
    # Beta's worker reports 4 running: this ingress's one and another ingress's 3. Beta's pool
    # has no room left; alpha's is no fuller.
    await admission.on_load(load_report("b1", running=4))
    with pytest.raises(Overloaded):
        await admission.admit("normal", "beta")
    alpha.pop().release()
    alpha.append(await admission.admit("normal", "alpha"))
    for ticket in [*alpha, beta]:
        ticket.release()
    assert admission.in_cluster == 3  # the other ingress's, on beta's worker


async def test_a_model_no_worker_serves_yet_is_not_bounded() -> None:
    """As with no worker at all: the request goes on, and the planner says no worker serves
    it."""
    admission = _pools(IngressMetrics())
    await admission.on_workers(_worker("a1", "alpha"))  # type: ignore[arg-type]
    tickets = [await admission.admit("normal", "beta") for _ in range(10)]
    assert admission.in_cluster == 10
    for ticket in tickets:
        ticket.release()


async def test_a_pool_whose_workers_left_goes_once_it_holds_nothing() -> None:
    """Workers name their own models: a pool per name ever seen would grow without end."""
    metrics = IngressMetrics()
    admission = _pools(metrics)
    for i in range(50):
        await admission.on_workers(_worker(f"w{i}", f"model-{i}"))  # type: ignore[arg-type]
    held = await admission.admit("normal", "model-49")
    await admission.on_workers({})
    assert sample(metrics, "laneway_ingress_admission_capacity") == 0
    assert list(admission._pools) == ["model-49"]  # it still holds a request
    held.release()
    await admission.on_workers({})
    assert not admission._pools
