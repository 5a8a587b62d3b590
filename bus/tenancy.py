"""Where the ingress replicas share what each holds of each tenant's limits, in etcd
(services.ingress.shared_limits): ``<TENANCY_PREFIX><tenant>/<replica>``, and each live replica's
mark under ``REPLICAS_PREFIX`` (``-`` starts no tenant's name, so the two never meet)."""

from __future__ import annotations

TENANCY_PREFIX = b"/laneway/tenancy/"
REPLICAS_PREFIX = TENANCY_PREFIX + b"-/"


def tenant_prefix(tenant: str) -> bytes:
    return TENANCY_PREFIX + tenant.encode() + b"/"
