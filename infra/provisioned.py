"""The users `laneway bus provision` made for servers the operator runs, kept in a folder of its
own (``infra.cluster_auth``'s layout: ``nats/<user>.json``, ``etcd/<user>.json``, 0600), and how
`laneway up --bus-credentials` hands them to its services.

A worker's id is spent once a process has used it: the kv-indexer folds each worker's events in
the order of their numbers from 1, and a worker's durable holds the routes of its id, so a
worker started again (or in a later run) takes a worker user not used before. Spent users are
listed in the folder's ``spent`` file: `laneway bus provision` run again leaves them out of the
NATS users it writes and deletes their etcd users, and adds fresh ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bus.permissions import KEY_ROLES, ROLES, Identity

NATS_ACCOUNTS_FILE = "nats-accounts.conf"
SPENT_FILE = "spent"


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

    def unspent(self) -> list[Identity]:
        spent = self.spent()
        return [i for i in self.identities() if i.user not in spent]

    def spent(self) -> set[str]:
        path = self.folder / SPENT_FILE
        return set(path.read_text().split()) if path.exists() else set()

    def spend(self, identity: Identity) -> None:
        """Once a process takes ``identity`` (a worker's): never handed out again."""
        fd = os.open(self.folder / SPENT_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as file:
            file.write(identity.user + "\n")

    def servers(self) -> tuple[str, ...]:
        """The servers these users are made on: NATS, and etcd where it had auth."""
        return ("nats", "etcd") if (self.folder / "etcd").is_dir() else ("nats",)

    def take(self, role: str, taken: set[Identity]) -> Identity:
        """An unspent identity of ``role`` not in ``taken``; a worker's is spent at once."""
        for identity in self.unspent():
            if identity.role == role and identity not in taken:
                if role == "worker":
                    self.spend(identity)
                return identity
        raise NoIdentityLeft(
            f"{self.folder} has no unspent {role} user left: run `laneway bus provision` "
            f"again (--workers, --ingresses, --kv-indexers), then reload nats-server"
        )
