"""The users `laneway bus provision` made for servers the operator runs, kept in a folder of its
own, and how they are handed to services (`laneway up` and `laneway serve` with
``--bus-credentials``). A user's credentials are ``nats/<user>.json`` and ``etcd/<user>.json``
(0600), or ``nats.<user>.json`` and ``etcd.<user>.json`` side by side, as a Kubernetes Secret
mounts them (its keys hold no '/').

A worker's id is used once: the kv-indexer folds each worker's events in the order of their
numbers from 1, and a worker's durable holds the routes of its id. So a worker, started again or
in a later run, on this host or another with a copy of the folder, takes a worker user no
process took before: it claims the user in etcd (``bus.registry.claim``, as that user where etcd
has users), and a claimed user is spent. `laneway serve` claims an ingress's and a kv-indexer's
user alike (two processes must never share one). `laneway bus provision` run again drops the
spent users from NATS's accounts and from etcd, and adds fresh ones.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from bus.client import Bus
from bus.credentials import Credentials, split_credentials
from bus.permissions import KEY_ROLES, ROLES, Identity
from bus.provision import ensure_consumer, ensure_streams
from bus.registry import claim, connect_etcd
from bus.settings import ServiceSettings
from bus.topology import worker_routes

NATS_ACCOUNTS_FILE = "nats-accounts.conf"


class NoIdentityLeft(RuntimeError):
    """The folder has no unspent user for a service: provision more."""


def identity_of_user(user: str) -> Identity | None:
    """The identity whose user name is ``user``; None for a name that is no identity's."""
    for role in sorted(ROLES, key=len, reverse=True):
        keyed = role in KEY_ROLES.values()
        if not keyed and user == role:
            return Identity(role)
        if keyed and user.startswith(role + "-"):
            try:
                return Identity(role, user[len(role) + 1 :])
            except ValueError:
                return None
    return None


@dataclass(frozen=True)
class Provisioned:
    folder: Path

    def check(self) -> None:
        if not self.identities():
            raise NoIdentityLeft(
                f"{self.folder} holds no NATS users: make them with `laneway bus provision`"
            )

    def path(self, server: str, user: str) -> Path:
        """Where the folder keeps ``user``'s credentials for ``server`` (nats, etcd)."""
        flat = self.folder / f"{server}.{user}.json"
        return flat if flat.exists() else self.folder / server / f"{user}.json"

    def identities(self) -> list[Identity]:
        """Every identity with NATS credentials here, spent ones included, in name order."""
        files = [*(self.folder / "nats").glob("*.json"), *self.folder.glob("nats.*.json")]
        names = sorted({p.name.removeprefix("nats.").removesuffix(".json") for p in files})
        found = (identity_of_user(name) for name in names)
        return [identity for identity in found if identity is not None]

    def servers(self) -> tuple[str, ...]:
        """The servers these users are made on: NATS, and etcd where it had auth."""
        etcd = (self.folder / "etcd").is_dir() or any(self.folder.glob("etcd.*.json"))
        return ("nats", "etcd") if etcd else ("nats",)

    def take(self, role: str, taken: set[Identity]) -> Identity:
        """An identity of ``role`` not in ``taken``, unclaimed (for `laneway up`, whose
        services share one host: see ``claim`` for others)."""
        for identity in self.identities():
            if identity.role == role and identity not in taken:
                return identity
        raise self._none_left(role)

    async def claim(self, role: str, etcd_endpoints: str, taken: set[Identity]) -> Identity:
        """An identity of ``role`` no process took before, claimed for this one in etcd (at
        ``etcd_endpoints``, as that identity's own user where the folder has one)."""
        by = f"{socket.gethostname()}/{os.getpid()}/{time.time():.0f}"
        plain = split_credentials(etcd_endpoints)[1]
        for identity in self.identities():
            if identity.role != role or identity in taken:
                continue
            own = self.path("etcd", identity.user)
            endpoints = Credentials.read(own).within(plain) if own.exists() else etcd_endpoints
            client = connect_etcd(endpoints)
            try:
                if await claim(client, identity.user, by):
                    return identity
            finally:
                await client.close()
        raise self._none_left(role)

    def _none_left(self, role: str) -> NoIdentityLeft:
        return NoIdentityLeft(
            f"{self.folder} has no {role} user left that no process took: run `laneway bus "
            "provision` again (--workers, --ingresses, --kv-indexers), then reload nats-server"
        )


async def make_streams(folder: Provisioned, nats_url: str, workers: list[Identity]) -> None:
    """As the folder's admin: the streams, the object store's bucket, the planners' durable and
    each of ``workers``' durables, which no service's own user may make."""
    admin = Credentials.read(folder.path("nats", "admin"))
    bus = await Bus.connect(admin.within(split_credentials(nats_url)[1]), "laneway-bus-admin")
    try:
        await ensure_streams(bus.js, ServiceSettings().stream_replicas)
        for worker in workers:
            await ensure_consumer(bus.js, worker_routes(worker.instance))
    finally:
        await bus.close()
