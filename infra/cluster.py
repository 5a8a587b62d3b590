"""A whole local cluster as OS processes: embedded NATS and etcd (unless given), then ingress,
planner, kv-indexer and the workers, each its own process; stopped in reverse order by PID.

Every child dies with the process that starts the cluster, and the state directory is locked
while the cluster runs (``infra.statedir``); ``supervise`` restarts a child that exits. What
keeps the cluster from starting is raised as a ``StartupError`` whose message is one line: a port
in use, the state directory taken, a child that died while starting (its name and the cause from
its log)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bus.credentials import split_credentials
from bus.permissions import Identity
from bus.registry import PLANNERS_PREFIX, WORKERS_PREFIX, connect_etcd
from bus.tls import BusTlsDir
from infra.bus_servers import bus_tls, embedded_etcd, embedded_nats
from infra.cluster_auth import (
    AUTH_FOLDER,
    BY_ADMIN_ENV,
    ClusterAuth,
    identity_of,
    open_etcd,
    provide,
    say_given_credentials,
    secure,
)
from infra.cluster_plan import ClusterConfig, Service, plan_services
from infra.embedded import EmbeddedServer, die_with_parent, is_nats
from infra.keys import STARTUP_KEY_FILE, startup_key
from infra.metrics_targets import assign_metrics_ports
from infra.provisioned import NoIdentityLeft, Provisioned
from infra.startup import StartupError, check_port_free, check_reachable, log_cause
from infra.statedir import StateDir, open_log
from infra.supervisor import Child, GaveUp, Supervisor
from schemas.events import new_id

logger = logging.getLogger(__name__)


class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.servers: list[EmbeddedServer] = []
        self.services: list[Service] = []
        self.nats_url = config.nats_url or ""
        self.etcd_endpoints = config.etcd_endpoints or ""
        self.state = StateDir(config.state_dir)
        self._auth: ClusterAuth | None = None
        self._provisioned = Provisioned(config.bus_credentials or config.state_dir)
        # The key this run made for itself, where the API takes keys.
        self.api_key: str | None = None

    @property
    def logs(self) -> Path:
        return self.config.state_dir / "logs"

    @property
    def prometheus_targets(self) -> Path:
        """Every service's metrics port, as a Prometheus ``file_sd_configs`` file."""
        return self.config.state_dir / "prometheus-targets.json"

    def start(self, timeout: float = 60.0) -> None:
        cfg = self.config
        try:
            leftovers = self.state.acquire()
            if leftovers:
                logger.warning(
                    "stopped what an earlier run left running on %s (pids %s)",
                    cfg.state_dir,
                    ", ".join(map(str, leftovers)),
                )
            self._check_ports()
            tls = bus_tls(cfg.bus_tls)
            self.logs.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Planned first: the embedded servers' users are the services' identities.
            self.services = plan_services(cfg)
            self._auth = auth = self._plan_auth()
            users = auth.nats_authorization() if auth and not cfg.nats_url else ""
            if not cfg.nats_url:
                self.nats_url = self._embed(
                    embedded_nats(cfg.state_dir, self.logs, cfg.ha, cfg.nats_port, users, tls)
                )
            if not cfg.etcd_endpoints:
                self.etcd_endpoints = self._embed(
                    embedded_etcd(cfg.state_dir, self.logs, cfg.ha, cfg.etcd_port, tls)
                )
            self._connect_services(auth, tls)
            self._guard_api()
            assign_metrics_ports(self.services, self.prometheus_targets)
            for service in self.services:
                self.spawn(service)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _plan_auth(self) -> ClusterAuth | None:
        """Whose credentials each planned service gets: users made here for the embedded
        servers, or those `laneway bus provision` made on the operator's (each service's id
        then one of its users')."""
        cfg = self.config
        if cfg.bus_credentials is not None:
            if not (cfg.nats_url and cfg.etcd_endpoints):
                raise StartupError(
                    "--bus-credentials is for servers given by --nats-url and --etcd-endpoints"
                )
            self._provisioned = Provisioned(cfg.bus_credentials)
            try:
                provide(self.services, self._provisioned, cfg.etcd_endpoints)
            except NoIdentityLeft as exc:
                raise StartupError(str(exc)) from None
            return ClusterAuth(cfg.bus_credentials, self._identities(), provisioned=True)
        return ClusterAuth(cfg.state_dir / AUTH_FOLDER, self._identities()) if cfg.auth else None

    def _identities(self) -> list[Identity]:
        return [identity_of(s) for s in self.services]

    def _embedded(self) -> tuple[str, ...]:
        """The servers this cluster runs itself, where each service gets a user of its own."""
        cfg = self.config
        return tuple(
            s for s, given in (("nats", cfg.nats_url), ("etcd", cfg.etcd_endpoints)) if not given
        )

    def _embed(self, servers: list[EmbeddedServer]) -> str:
        """Keep started servers for stopping; their URLs as the services take them."""
        self.servers += servers
        self.state.record(self.pids())
        return ",".join(server.url for server in servers)

    def _check_ports(self) -> None:
        """Before anything starts: a port in use, or a server given that does not answer, is one
        line naming it, not a child's death or a wait until the start times out."""
        cfg = self.config
        if cfg.ha and (cfg.nats_port or cfg.etcd_port):
            raise StartupError(
                "--nats-port and --etcd-port place the single embedded servers; "
                "--ha starts three of each on free ports"
            )
        check_port_free(cfg.http_host, cfg.http_port, "HTTP", "--port")
        if cfg.nats_url:
            check_reachable(cfg.nats_url, 4222, "NATS", "--nats-url")
        elif cfg.nats_port:
            check_port_free("127.0.0.1", cfg.nats_port, "NATS", "--nats-port")
        if cfg.etcd_endpoints:
            check_reachable(cfg.etcd_endpoints, 2379, "etcd", "--etcd-endpoints")
        elif cfg.etcd_port:
            check_port_free("127.0.0.1", cfg.etcd_port, "etcd", "--etcd-port")

    def _connect_services(self, auth: ClusterAuth | None, tls: BusTlsDir | None) -> None:
        """Each service's servers and, where auth is on, the files of its own credentials; from
        here on ``nats_url`` and ``etcd_endpoints`` carry the admin's, for tools and tests."""
        cfg = self.config
        common = {"LANEWAY_NATS_URL": self.nats_url, "LANEWAY_ETCD_ENDPOINTS": self.etcd_endpoints}
        if tls is not None:
            common.update(tls.env())
        # The servers on which each service has a user of its own.
        ours = self._embedded()
        replicas = 3 if cfg.ha else 1
        if auth is not None and auth.provisioned:
            ours = self._provisioned.servers()
            self.nats_url = secure(auth, self.nats_url, "", replicas, nats=True, etcd=False)[0]
            if "etcd" in ours:
                self.etcd_endpoints = auth.admin("etcd").within(self.etcd_endpoints)
        elif auth is not None:
            self.nats_url, self.etcd_endpoints = secure(
                auth, self.nats_url, self.etcd_endpoints, replicas, "nats" in ours, "etcd" in ours
            )
        say_given_credentials(cfg.nats_url, cfg.etcd_endpoints, ours if auth is not None else ())
        if auth is None and not cfg.etcd_endpoints:
            try:
                open_etcd(cfg.state_dir / AUTH_FOLDER, self.etcd_endpoints)
            except PermissionError as exc:
                raise StartupError(
                    f"{exc}: remove {cfg.state_dir}/etcd* (worker leases and session owners "
                    "only) or start without --no-bus-auth"
                ) from None
        for service in self.services:
            service.env.update(common)
            if auth is not None:
                service.env.update(auth.env(identity_of(service), ours))
                if "nats" in ours:
                    service.env.update(BY_ADMIN_ENV)

    def spawn(self, service: Service) -> None:
        service.log_file = self.logs / f"{service.name}.log"
        log = open_log(service.log_file)  # the child owns it
        service.proc = subprocess.Popen(
            [sys.executable, "-m", service.module],
            env={**os.environ, **service.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        log.close()
        self.state.record(self.pids())

    def supervise(self, stop: threading.Event) -> None:
        """Keep every child up until ``stop`` is set (see ``infra.supervisor``); raises
        ``GaveUp`` when one cannot be. Run it on the thread that started the cluster."""
        Supervisor(self._children, self._respawn, self.config.restart).run(stop)

    def _children(self) -> list[Child]:
        # Servers first: restarted before the services that use them.
        return [*self.servers, *self.services]

    def _respawn(self, child: Child) -> None:
        if isinstance(child, EmbeddedServer):
            child.respawn()  # the same ports and data; the services reconnect by themselves
            self.state.record(self.pids())
        else:
            service = self.service(child.name)
            if "LANEWAY_WORKER_ID" in service.env:
                self._new_worker_id(service)
            self.spawn(service)

    def _new_worker_id(self, service: Service) -> None:
        """A restarted worker is a new worker: its KV events count from 1 again, and its
        predecessor's lease and route consumer must not be taken for its own. With auth on it
        gets credentials for the new id."""
        before = identity_of(service)
        auth = self._auth
        if auth is not None and auth.provisioned:
            in_use = {identity_of(s) for s in self.services}
            claiming = self._provisioned.claim("worker", self.config.etcd_endpoints or "", in_use)
            try:
                with ThreadPoolExecutor(1) as pool:
                    identity = pool.submit(asyncio.run, claiming).result()
            except NoIdentityLeft as exc:
                raise GaveUp(f"{service.name} cannot start again: {exc}") from None
            service.env["LANEWAY_WORKER_ID"] = identity.instance
            at = split_credentials(self.nats_url)[1]
            auth.add(identity, [], None, replaces=before, durables_at=at)
            service.env.update(auth.env(identity, self._provisioned.servers()))
        elif auth is not None:
            service.env["LANEWAY_WORKER_ID"] = new_id()
            identity = identity_of(service)
            cfg = self.config
            nats = [] if cfg.nats_url else [s for s in self.servers if is_nats(s)]
            etcd = None if cfg.etcd_endpoints else self.etcd_endpoints
            auth.add(identity, nats, etcd, replaces=before)
            service.env.update(auth.env(identity, self._embedded()))
        else:
            service.env["LANEWAY_WORKER_ID"] = new_id()

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def ingresses(self) -> list[Service]:
        return [s for s in self.services if s.module == "services.ingress"]

    def wait_ready(self, timeout: float) -> None:
        """Ready when the API answers, every service's ``/readyz`` says ready, every worker
        holds a lease in etcd and every planner replica consumes requests."""
        deadline = time.monotonic() + timeout
        workers = self.config.decode_workers + self.config.prefill_workers
        missing = ""
        while time.monotonic() < deadline:
            self._check_alive()
            missing = self._missing(workers)
            if not missing:
                return
            time.sleep(0.2)
        raise StartupError(f"cluster not ready within {timeout:.0f}s: {missing}; logs: {self.logs}")

    def _missing(self, workers: int) -> str:
        """What the cluster still waits for, in words; empty once it is ready."""
        if not self._api_up():
            return f"the API at {self.config.base_url} does not answer"
        # Each process, not only the one that answered: replicas share the API's port.
        starting = [s.name for s in self.services if s.metrics_port and not _ready(s)]
        if starting:
            return "not ready yet: " + ", ".join(starting)
        registered = self._count_keys(WORKERS_PREFIX)
        if registered < workers:
            return f"{registered} of {workers} workers registered"
        planners = self._count_keys(PLANNERS_PREFIX)
        if planners < self.config.planners:
            return f"{planners} of {self.config.planners} planners consume requests"
        return ""

    def _check_alive(self) -> None:
        for service in self.services:
            if service.proc is not None and service.proc.poll() is not None:
                log = self.logs / f"{service.name}.log"
                cause = log_cause(log) or "no output"
                raise StartupError(
                    f"{service.name} failed to start: {cause} "
                    f"(exit code {service.proc.returncode}; log: {log})"
                )

    def _guard_api(self) -> None:
        """Once etcd is up: the API's keys, with one made for this run, and HTTPS, as set."""
        cfg = self.config
        if cfg.api_auth:
            self.api_key = startup_key(self.etcd_endpoints, cfg.state_dir)
        for ingress in self.ingresses():
            env = ingress.env
            if cfg.api_auth:
                env["LANEWAY_API_AUTH"] = "true"
            if cfg.api_tls is not None:
                env["LANEWAY_API_TLS_CERTFILE"], env["LANEWAY_API_TLS_KEYFILE"] = map(
                    str, cfg.api_tls
                )

    @property
    def api_headers(self) -> dict[str, str]:
        """What a client of this cluster's API sends: the run's key, where the API takes keys."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _api_up(self) -> bool:
        try:
            # Our own child, on the caller's certificate: whether it answers is the question.
            reply = httpx.get(
                self.config.base_url + "/models",
                headers=self.api_headers,
                timeout=1.0,
                verify=False,
            )
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    def _count_keys(self, prefix: bytes) -> int:
        async def count() -> int:
            client = connect_etcd(self.etcd_endpoints)
            try:
                return len(list(await client.get_prefix(prefix, keys_only=True)))
            finally:
                await client.close()

        # A thread of its own, so that this also works when the caller runs an event loop.
        with ThreadPoolExecutor(1) as pool:
            try:
                return pool.submit(asyncio.run, count()).result()
            except Exception:  # etcd still starting
                return 0

    def stop(self, timeout: float = 15.0) -> None:
        # Front door first, so that nothing new comes in while the back drains.
        for service in reversed(self.services):
            if service.proc is not None and service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for service in reversed(self.services):
            if service.proc is None:
                continue
            try:
                service.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()
        for server in reversed(self.servers):
            server.stop()
        self.servers.clear()
        # The run's key is revoked by the next start; a stopped run hands it to no one (a run
        # refused the state dir made none, and leaves its owner's).
        if self.api_key is not None:
            (self.config.state_dir / STARTUP_KEY_FILE).unlink(missing_ok=True)
        self.state.release()

    def pids(self) -> dict[str, int]:
        pids = {f"{s.name} (embedded)": s.proc.pid for s in self.servers}
        pids.update({s.name: s.proc.pid for s in self.services if s.proc is not None})
        return pids


def _ready(service: Service) -> bool:
    """Whether the service's own ``/readyz`` says it is ready."""
    try:
        reply = httpx.get(f"http://127.0.0.1:{service.metrics_port}/readyz", timeout=1.0)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200
