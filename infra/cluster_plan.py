"""What a local cluster is made of: its settings, and the services it runs with the settings each
is started with (pure: ``infra.cluster`` starts them)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from infra.supervisor import RestartPolicy
from schemas.events import new_id


@dataclass
class ClusterConfig:
    state_dir: Path
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    nats_url: str | None = None
    etcd_endpoints: str | None = None
    nats_port: int | None = None
    etcd_port: int | None = None
    workers: int = 2
    # Model pools: each model's name and how many workers serve it, instead of ``workers``
    # serving their own setting's model. The ingress serves every pool's name.
    pools: dict[str, int] = field(default_factory=dict)
    prefill_workers: int = 0
    planners: int = 1
    indexers: int = 1
    # Ingress processes, all on the API's port (SO_REUSEPORT): more than one core's worth of
    # HTTP and streams.
    ingresses: int = 1
    policy: str = "kv"
    # A 3-node JetStream cluster and a 3-member etcd cluster instead of single nodes (those not
    # given by URL), every stream on 3 of the servers.
    ha: bool = False
    # Extra LANEWAY_* settings for every service (perf model, speed-up, lease TTL, tracing, …).
    env: dict[str, str] = field(default_factory=dict)
    # Every API request but /health needs a key: one is made at each start (``api_key``, and
    # STATE_DIR/api-key while it runs); False for experiments.
    api_auth: bool = True
    # The API over HTTPS, with this PEM certificate (chain) and its private key.
    api_tls: tuple[Path, Path] | None = None
    # NATS and etcd over TLS (``bus.tls.BusTlsDir``): the embedded servers serve its server
    # certificate, and require its client certificate where it has one; services connect with
    # its CA (and client certificate), to servers given by URL too.
    bus_tls: Path | None = None
    # A NATS user per service with only its subjects, and etcd auth, on the embedded servers
    # (servers given by URL are their operator's to secure); False for experiments.
    auth: bool = True
    # The folder of `laneway bus provision` for the NATS and etcd given by URL: each service
    # runs there as a user of its own, which the operator's servers know.
    bus_credentials: Path | None = None
    # How `supervise` restarts a child that exits.
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    @property
    def decode_workers(self) -> int:
        """The workers that decode: the pools', or ``workers``."""
        return sum(self.pools.values()) if self.pools else self.workers

    @property
    def base_url(self) -> str:
        scheme = "http" if self.api_tls is None else "https"
        return f"{scheme}://{self.http_host}:{self.http_port}/v1"


@dataclass
class Service:
    name: str
    module: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    # Where its /metrics, /healthz and /readyz answer (observability.metrics).
    metrics_port: int = 0
    log_file: Path | None = None


def plan_services(cfg: ClusterConfig) -> list[Service]:
    """The cluster's services, with the settings each is started with, in start order."""
    common = {**cfg.env, **({"LANEWAY_STREAM_REPLICAS": "3"} if cfg.ha else {})}
    services = [
        Service(
            _name("kv-indexer", i, cfg.indexers),
            "services.kv_indexer",
            {**common, "LANEWAY_INSTANCE_ID": f"indexer-{i}"},
        )
        for i in range(cfg.indexers)
    ]
    services += [
        Service(
            _name("planner", i, cfg.planners),
            "services.planner",
            {**common, "LANEWAY_POLICY": cfg.policy},
        )
        for i in range(cfg.planners)
    ]
    # Beside a prefill pool the others decode (the decode worker's own role); alone they
    # serve requests end to end.
    role = {} if cfg.prefill_workers else {"LANEWAY_ROLE": "both"}
    # Ids given here, so that each has its own credentials (see infra.cluster_auth).
    # Each worker's model: its pool's, else its own setting's.
    models = [{"LANEWAY_MODEL": name} for name, n in cfg.pools.items() for _ in range(n)]
    services += [
        Service(
            f"decode-worker-{i}",
            "services.worker.decode_worker",
            {**role, **common, **model, "LANEWAY_WORKER_ID": new_id()},
        )
        for i, model in enumerate(models or [{}] * cfg.decode_workers)
    ]
    services += [
        Service(
            f"prefill-worker-{i}",
            "services.worker.prefill_worker",
            {**common, "LANEWAY_WORKER_ID": new_id()},
        )
        for i in range(cfg.prefill_workers)
    ]
    served = {"LANEWAY_SERVED_MODEL_NAMES": json.dumps(list(cfg.pools))} if cfg.pools else {}
    services += [
        Service(
            _name("ingress", i, cfg.ingresses),
            "services.ingress",
            {
                **common,
                "LANEWAY_HOST": cfg.http_host,
                "LANEWAY_PORT": str(cfg.http_port),
                "LANEWAY_REUSE_PORT": str(cfg.ingresses > 1).lower(),
                "LANEWAY_INSTANCE_ID": new_id(),
                **served,
            },
        )
        for i in range(cfg.ingresses)
    ]
    return services


def _name(kind: str, i: int, count: int) -> str:
    """A replica's service name: the kind alone when it is the only one."""
    return kind if count == 1 else f"{kind}-{i}"
