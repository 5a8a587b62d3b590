"""The worker's two entry points start in the role of their name; `laneway up` without a prefill
pool runs its decode workers in role `both` (aggregated serving)."""

from __future__ import annotations

from tests.live import ClusterFactory, registrations


async def test_aggregated_workers_serve_both_roles(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=2)
    workers = await registrations(cluster.etcd_endpoints)
    assert sorted(r.role for r in workers.values()) == ["both", "both"]


async def test_beside_a_prefill_pool_the_workers_decode(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(workers=1, prefill_workers=1)
    workers = await registrations(cluster.etcd_endpoints)
    assert sorted(r.role for r in workers.values()) == ["decode", "prefill"]
