"""The users `laneway bus provision` made for servers the operator runs, kept in a folder of its
own (``infra.cluster_auth``'s layout: ``nats/<user>.json``, ``etcd/<user>.json``, 0600), and how
they are handed to services (`laneway up --bus-credentials`).

A worker's id is used once: the kv-indexer folds each worker's events in the order of their
numbers from 1, and a worker's durable holds the routes of its id. So a worker, started again or
in a later run, on this host or another with a copy of the folder, takes a worker user no
process took before: it claims the id in etcd (``bus.registry.claim``, as that user where etcd
has users), and a claimed id is spent. `laneway bus provision` run again drops the spent users
from NATS's accounts and from etcd, and adds fresh ones.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from bus.credentials import Credentials, split_credentials
from bus.permissions import KEY_ROLES, ROLES, Identity
from bus.registry import claim, connect_etcd

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
        if not (self.folder / "nats").is_dir():
            raise NoIdentityLeft(
                f"{self.folder} holds no NATS users: make them with `laneway bus provision`"
            )

    def identities(self) -> list[Identity]:
        """Every identity with NATS credentials here, spent ones included, in name order."""
        found = (identity_of_user(p.stem) for p in sorted((self.folder / "nats").glob("*.json")))
        return [identity for identity in found if identity is not None]

    def servers(self) -> tuple[str, ...]:
        """The servers these users are made on: NATS, and etcd where it had auth."""
        return ("nats", "etcd") if (self.folder / "etcd").is_dir() else ("nats",)

    def take(self, role: str, taken: set[Identity]) -> Identity:
        """An identity of ``role`` (not a worker: see ``claim_worker``) not in ``taken``."""
        for identity in self.identities():
            if identity.role == role and identity not in taken:
                return identity
        raise self._none_left(role)

    async def claim_worker(self, etcd_endpoints: str, taken: set[Identity]) -> Identity:
        """A worker identity no process took before, claimed for this one in etcd (at
        ``etcd_endpoints``, as the worker's own user where the folder has one)."""
        by = f"{socket.gethostname()}/{os.getpid()}/{time.time():.0f}"
        plain = split_credentials(etcd_endpoints)[1]
        for identity in self.identities():
            if identity.role != "worker" or identity in taken:
                continue
            own = self.folder / "etcd" / f"{identity.user}.json"
            endpoints = Credentials.read(own).within(plain) if own.exists() else etcd_endpoints
            client = connect_etcd(endpoints)
            try:
                if await claim(client, identity.instance, by):
                    return identity
            finally:
                await client.close()
        raise self._none_left("worker")

    def _none_left(self, role: str) -> NoIdentityLeft:
        return NoIdentityLeft(
            f"{self.folder} has no {role} user left that no process took: run `laneway bus "
            "provision` again (--workers, --ingresses, --kv-indexers), then reload nats-server"
        )
