"""Connection settings every service shares, read from ``LANEWAY_*`` environment variables."""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger(__name__)


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LANEWAY_", extra="ignore")

    # Settings renamed: each old environment variable, and the field that took it over. An old
    # name is read for a release, with a one-line warning, so that operators' environments keep
    # working; the new name wins where both are set.
    renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _read_renamed(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for old, field in cls.renamed.items():
            value = os.environ.get(old)
            if value is None or field in data:
                continue
            new = cls.model_config.get("env_prefix", "") + field.upper()
            log.warning("%s is deprecated and goes in the next release: use %s", old, new)
            data = {**data, field: value}
        return data

    # Either may list a cluster's members, comma-separated; clients fail over between them.
    nats_url: str = "nats://127.0.0.1:4222"
    etcd_endpoints: str = "127.0.0.1:2379"
    # Servers that store each stream: 1 on a single NATS, 3 on a cluster.
    stream_replicas: int = Field(default=1, ge=1, le=5)
    # The admin made the streams, the object store's bucket and the durables (`laneway up`
    # with bus auth), which the services' own NATS users may not: use them, make nothing.
    # False: each service makes what is missing (an open NATS).
    bus_provisioned: bool = False
    # none | console | otlp | file:PATH (see observability.tracing)
    trace_exporter: str = "none"
    log_level: str = "INFO"
    # The metrics port (/metrics, /healthz, /readyz: observability.metrics); 0 serves none.
    # laneway up gives each service a free one; a pod sets it (and 0.0.0.0 for the host).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, ge=0, le=65535)
