"""The credentials of a local cluster: one NATS and one etcd user per service identity, an
admin for tools and etcd's root for the bootstrap, kept in ``<state dir>/auth/`` (0700, each
file 0600) so that a restart on the same data finds them. Services get the paths of their own
files in their environment."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import nats

from bus.accounts import account_links, account_of
from bus.client import Bus
from bus.credentials import ETCD_CREDS_ENV, NATS_CREDS_ENV, Credentials, split_credentials
from bus.etcd_auth import ROOT, disable_auth, enable_auth, remove_users
from bus.permissions import Identity, nats_permissions
from bus.provision import delete_consumer, ensure_consumer, ensure_streams
from bus.tls import nats_tls_from_env
from bus.topology import worker_routes
from infra.embedded import EmbeddedServer, reload_nats
from infra.provisioned import Provisioned

ADMIN = Identity("admin")
# The credentials' folder in a `laneway up`'s state dir.
AUTH_FOLDER = "auth"
# A service whose NATS user ClusterAuth made on the embedded servers: the admin made the streams
# and its durable, which its own user may not.
BY_ADMIN_ENV = {"LANEWAY_BUS_PROVISIONED": "true"}
logger = logging.getLogger(__name__)


class Planned(Protocol):
    """A service as the cluster plans it (``infra.cluster.Service``)."""

    @property
    def module(self) -> str: ...

    @property
    def env(self) -> dict[str, str]: ...


def identity_of(service: Planned) -> Identity:
    """Who a planned service is, from its module and the ids it is given."""
    if service.module.startswith("services.worker."):
        return Identity("worker", service.env["LANEWAY_WORKER_ID"])
    if service.module == "services.planner":
        return Identity("planner")
    if service.module == "services.kv_indexer":
        return Identity("kv-indexer", service.env["LANEWAY_INSTANCE_ID"])
    if service.module == "services.ingress":
        return Identity("ingress", service.env["LANEWAY_INSTANCE_ID"])
    raise ValueError(f"no identity for {service.module}")


async def _wait_login(url: str, timeout: float = 10.0) -> None:
    """Until the server takes these credentials (a reload is applied in its own time)."""

    async def quiet(_: Exception) -> None:
        return None

    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            nc = await nats.connect(
                url, allow_reconnect=False, error_cb=quiet, tls=nats_tls_from_env()
            )
            await nc.close()
            return
        except nats.errors.Error:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def provide(services: Sequence[Planned], provisioned: Provisioned, etcd_endpoints: str) -> None:
    """Each planned service's id set to one of ``provisioned``'s users (a worker's claimed in
    etcd, at ``etcd_endpoints``), so that it runs as that user; NoIdentityLeft where there are
    too few."""
    provisioned.check()
    taken: set[Identity] = set()

    async def run() -> None:
        for service in services:
            role = identity_of(service).role
            if role == "planner":  # its replicas share one user
                continue
            if role == "worker":
                identity = await provisioned.claim("worker", etcd_endpoints, taken)
            else:
                identity = provisioned.take(role, taken)
            taken.add(identity)
            variable = "LANEWAY_WORKER_ID" if role == "worker" else "LANEWAY_INSTANCE_ID"
            service.env[variable] = identity.instance

    # A thread of its own, so that this also works when the caller runs an event loop.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()


def say_given_credentials(nats_url: str | None, etcd: str | None, ours: tuple[str, ...]) -> None:
    """Once per start: on the servers given (``nats_url``, ``etcd``) where the services have no
    users of their own (``ours``: where they have), they share whatever credentials those were
    given with (none, where they let anyone in)."""
    given = [
        f"{name} at {split_credentials(address)[1]}"
        for name, address in (("nats", nats_url), ("etcd", etcd))
        if address and name not in ours
    ]
    if given:
        logger.warning(
            "every service uses the credentials given for %s; `laneway bus provision` makes a "
            "user per service with only what it needs (docs/operations.md)",
            " and ".join(given),
        )


def admin_within(service_creds: str | None, addresses: str) -> str:
    """``addresses`` with the credentials of the admin beside a service's (``laneway up`` keeps
    them in one folder), for a tool of the same user that finds the services' settings."""
    if not service_creds:
        return addresses
    admin = Path(service_creds).parent / f"{ADMIN.user}.json"
    return Credentials.read(admin).within(addresses) if admin.exists() else addresses


def admin_files(state_dir: Path) -> dict[str, Path]:
    """The files of the admin's credentials that `laneway up` on ``state_dir`` made, by server
    (``nats``, ``etcd``: the embedded ones that take users), for tools of the same user; it names
    them, never prints what they hold."""
    folder = state_dir / AUTH_FOLDER
    files = {server: _file(folder, server, ADMIN.user) for server in ("nats", "etcd")}
    return {server: path for server, path in files.items() if path.exists()}


def _file(folder: Path, server: str, user: str) -> Path:
    return folder / server / f"{user}.json"


def secure(
    auth: ClusterAuth, nats_url: str, etcd_endpoints: str, replicas: int, nats: bool, etcd: bool
) -> tuple[str, str]:
    """Once the embedded servers listen: etcd's users and auth turned on (where ``etcd``), the
    streams, the object store's bucket and every durable made as the admin (where ``nats``: the
    services may only use them), and the servers' addresses with the admin's credentials in
    them."""

    async def run() -> None:
        if etcd:
            await enable_auth(etcd_endpoints, auth.etcd_root, auth.etcd_users())
        if nats:
            bus = await Bus.connect(auth.admin("nats").within(nats_url), "laneway-up")
            try:
                await ensure_streams(bus.js, replicas)
                for identity in auth.identities:
                    await _durables(bus, identity, made=True)
            finally:
                await bus.close()

    # A thread of its own, so that this also works when the caller runs an event loop.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()
    return (
        auth.admin("nats").within(nats_url) if nats else nats_url,
        auth.admin("etcd").within(etcd_endpoints) if etcd else etcd_endpoints,
    )


async def _durables(bus: Bus, identity: Identity, made: bool) -> None:
    """The durable a worker identity consumes its routes from, made (or deleted) as the admin:
    the worker may not make it itself (bus.permissions)."""
    if identity.role != "worker":
        return
    consumer = worker_routes(identity.instance)
    await (ensure_consumer if made else delete_consumer)(bus.js, consumer)


def open_etcd(folder: Path, etcd_endpoints: str) -> None:
    """An embedded etcd for a cluster without auth: its data may be from a run with auth (the
    same state dir), which left auth on; off again, as the root whose credentials ``folder``
    kept (a ``ClusterAuth`` folder). Where those are gone, PermissionError."""
    path = folder / "etcd" / f"{ROOT}.json"
    root = Credentials.read(path) if path.exists() else None
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, disable_auth(etcd_endpoints, root)).result()


class ClusterAuth:
    """``provisioned``: the folder of ``laneway bus provision``, whose users the operator's
    servers know: nothing is made here, and a user it lacks is an error."""

    def __init__(self, folder: Path, identities: list[Identity], provisioned: bool = False) -> None:
        self.folder = folder
        self.provisioned = provisioned
        # Replicas that share an identity (the planners) share its user.
        self.identities = list(dict.fromkeys([ADMIN, *identities]))
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, server: str, user: str) -> Path:
        return _file(self.folder, server, user)

    def credentials(self, server: str, user: str) -> Credentials:
        """The user's, made on first use."""
        path = self.path(server, user)
        if path.exists():
            return Credentials.read(path)
        if self.provisioned:
            raise FileNotFoundError(f"{path}: {self.folder} provisions no {server} user {user}")
        creds = Credentials.new(user)
        creds.write(path)
        return creds

    def nats_authorization(self) -> str:
        """The ``accounts`` block of a nats-server configuration: these users only, so an
        anonymous connection is refused, each in its role's account (bus.accounts)."""
        accounts: dict[str, dict[str, Any]] = {
            account: {"users": [], "exports": found.exports, "imports": found.imports}
            for account, found in account_links().items()
        }
        accounts["LANEWAY"]["jetstream"] = "enabled"
        for identity in self.identities:
            accounts[account_of(identity.role)]["users"].append(
                {
                    "user": identity.user,
                    "password": self.credentials("nats", identity.user).password,
                    "permissions": nats_permissions(identity).config(),
                }
            )
        return "accounts: " + json.dumps(accounts, indent=1) + "\n"

    def add(
        self,
        identity: Identity,
        nats_servers: list[EmbeddedServer],
        etcd_endpoints: str | None,
        replaces: Identity | None = None,
        durables_at: str | None = None,
    ) -> None:
        """A new identity on the running embedded servers (a worker restarted under a new id,
        ``replaces`` the one it had, which is retired: its users and durable deleted, its
        credentials' files removed, so that whoever holds them holds nothing): the NATS servers
        reload their users, the admin makes its durable, etcd (None: not ours) gets its user and
        role. Returns once NATS lets it in, or says in the log why it may not. On servers the
        operator runs (``provisioned``), the users exist already: ``durables_at`` is the NATS
        where the admin makes the new durable and deletes the old."""
        kept = [i for i in self.identities if i != replaces]
        self.identities = list(dict.fromkeys([*kept, identity]))
        if nats_servers:
            users = self.nats_authorization()
            for server in nats_servers:
                reload_nats(server, users)
        durables_at = durables_at or ",".join(server.url for server in nats_servers)

        async def run() -> None:
            if etcd_endpoints is not None:
                creds = {identity: self.credentials("etcd", identity.user)}
                await enable_auth(etcd_endpoints, self.etcd_root, creds)
                if replaces is not None:
                    await remove_users(etcd_endpoints, self.etcd_root, [replaces.user])
            if durables_at:
                bus = await Bus.connect(self.admin("nats").within(durables_at), "laneway-up")
                try:
                    await _durables(bus, identity, made=True)
                    if replaces is not None:
                        await _durables(bus, replaces, made=False)
                finally:
                    await bus.close()
            login = self.credentials("nats", identity.user)
            for server in nats_servers:
                await _wait_login(login.within(server.url))

        try:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, run()).result()
        except Exception:  # a server down now: the new service fails and is restarted later
            logger.warning("%s may not be let in yet", identity.user, exc_info=True)
        if replaces is not None:
            for kind in ("nats", "etcd"):
                self.path(kind, replaces.user).unlink(missing_ok=True)

    def etcd_users(self) -> dict[Identity, Credentials]:
        return {i: self.credentials("etcd", i.user) for i in self.identities}

    @property
    def etcd_root(self) -> Credentials:
        return self.credentials("etcd", ROOT)

    def admin(self, server: str) -> Credentials:
        return self.credentials(server, ADMIN.user)

    def env(
        self, identity: Identity, servers: tuple[str, ...] = ("nats", "etcd")
    ) -> dict[str, str]:
        """What hands a service its credentials for ``servers``: paths, not secrets."""
        variables = {"nats": NATS_CREDS_ENV, "etcd": ETCD_CREDS_ENV}
        return {variables[server]: str(self.path(server, identity.user)) for server in servers}
