"""`laneway bus provision`: least privilege on a NATS and an etcd the operator runs.

Run once (and again for more users) with etcd's root: it makes a user per service identity
(``bus.permissions``: each with only its subjects and keys, as on the servers `laneway up`
embeds) and writes, in a folder of the operator's choosing (0700, each file 0600):

- ``nats-accounts.conf``: the NATS accounts and users, for nats-server's configuration
  (``include``), taking effect on its next reload;
- ``nats/<user>.json`` and ``etcd/<user>.json``: each service's credentials, for
  ``laneway up --bus-credentials`` (which hands each service the path of its own);
- the etcd users and roles themselves, made at once where etcd takes users.

A worker user is spent once a worker claims it (``infra.provisioned``): run it again to add fresh
ones (``--workers`` counts the unspent) and to drop the spent from NATS and etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.credentials import ETCD_PASSWORD_ENV, ETCD_USER_ENV, etcd_credentials, split_credentials
from bus.etcd_auth import enable_auth, remove_users
from bus.permissions import ROLES, Identity
from bus.registry import CLAIMS_PREFIX, connect_etcd
from infra.arg_types import at_least
from infra.cluster_auth import ADMIN, ClusterAuth
from infra.provisioned import NATS_ACCOUNTS_FILE, Provisioned, make_streams
from schemas.events import new_id


@dataclass(frozen=True)
class Wanted:
    """How many unspent users of each keyed role the folder should hold."""

    workers: int = 16
    ingresses: int = 1
    indexers: int = 1


@dataclass(frozen=True)
class Provisioning:
    identities: list[Identity]
    etcd: str
    """What was done on etcd, in words."""


def provision(folder: Path, wanted: Wanted, etcd_endpoints: str | None) -> Provisioning:
    """The folder's users topped up to ``wanted``, the NATS accounts file written, and, with
    ``etcd_endpoints`` (as root where etcd has auth), the etcd users and roles made; the worker
    users a process claimed there are spent: dropped from the folder, the accounts and etcd."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    (folder / "nats").mkdir(mode=0o700, exist_ok=True)
    spent = _spent(etcd_endpoints) if etcd_endpoints else set()
    kept = []
    for identity in Provisioned(folder).identities():
        if identity.user not in spent:
            kept.append(identity)
            continue
        for server in ("nats", "etcd"):
            (folder / server / f"{identity.user}.json").unlink(missing_ok=True)
    identities = list(dict.fromkeys([ADMIN, Identity("planner"), *kept]))
    identities += [
        Identity("kv-indexer", f"indexer-{i}")
        for i in range(wanted.indexers)
        if Identity("kv-indexer", f"indexer-{i}") not in identities
    ]
    ingresses = sum(identity.role == "ingress" for identity in identities)
    identities += [Identity("ingress", new_id()) for _ in range(wanted.ingresses - ingresses)]
    workers = sum(identity.role == "worker" for identity in identities)
    identities += [Identity("worker", new_id()) for _ in range(wanted.workers - workers)]
    auth = ClusterAuth(folder, identities)
    accounts = auth.nats_authorization()  # makes each NATS user's credentials
    path = folder / NATS_ACCOUNTS_FILE
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(accounts)
    done = _etcd(auth, etcd_endpoints, sorted(spent)) if etcd_endpoints else "not given"
    return Provisioning(auth.identities, done)


def _spent(endpoints: str) -> set[str]:
    """The users claimed in etcd; none known where etcd refuses a caller without
    credentials (then no etcd users are made either)."""
    try:
        return asyncio.run(claimed(endpoints))
    except Exception:
        if etcd_credentials(endpoints) is None:
            return set()
        raise


async def claimed(endpoints: str) -> set[str]:
    """The users claimed in etcd (bus.registry.claim)."""
    client = connect_etcd(endpoints)
    try:
        found = await client.get_prefix(CLAIMS_PREFIX, keys_only=True)
    finally:
        await client.close()
    return {kv.key[len(CLAIMS_PREFIX) :].decode() for kv in found}


def _etcd(auth: ClusterAuth, endpoints: str, spent: list[str]) -> str:
    root = etcd_credentials(endpoints)
    shown = split_credentials(endpoints)[1]
    if root is None:
        return (
            f"no users made at {shown}: give its root as {ETCD_USER_ENV} and {ETCD_PASSWORD_ENV} "
            "(or in the endpoints) to make them; the services use none meanwhile"
        )

    async def run() -> bool:
        on = await enable_auth(endpoints, root, auth.etcd_users(), turn_on=False)
        if spent:
            await remove_users(endpoints, root, spent)
        return on

    on = asyncio.run(run())
    made = f"{len(auth.identities)} users and roles made at {shown}"
    return made if on else made + " (its auth is off: they take effect once it is on)"


def k8s_secrets(folder: Path) -> list[dict[str, Any]]:
    """The folder as Kubernetes Secrets: ``laneway-nats-accounts`` for nats-server, and per role
    ``laneway-bus-<role>`` with that role's users alone (``nats.<user>.json``,
    ``etcd.<user>.json``: the flat layout ``infra.provisioned`` reads), each mounted by that
    role's pods only."""
    held = Provisioned(folder)
    accounts = (folder / NATS_ACCOUNTS_FILE).read_text()
    secrets = [_secret("laneway-nats-accounts", {NATS_ACCOUNTS_FILE: accounts})]
    for role in ROLES:
        data = {
            f"{server}.{identity.user}.json": held.path(server, identity.user).read_text()
            for identity in held.identities()
            if identity.role == role
            for server in held.servers()
        }
        secrets.append(_secret(f"laneway-bus-{role}", data))
    return secrets


def _secret(name: str, data: dict[str, str]) -> dict[str, Any]:
    labels = {"app.kubernetes.io/part-of": "laneway"}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": labels},
        "type": "Opaque",
        "stringData": data,
    }


def _write_secrets(folder: Path, out: Path) -> None:
    text = "".join("---\n" + json.dumps(secret, indent=1) + "\n" for secret in k8s_secrets(folder))
    out.unlink(missing_ok=True)
    with os.fdopen(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


def _provision(args: argparse.Namespace) -> int:
    wanted = Wanted(args.workers, args.ingresses, args.kv_indexers)
    done = provision(args.out, wanted, args.etcd_endpoints)
    if args.k8s_secrets is not None:
        _write_secrets(args.out, args.k8s_secrets)
    roles = [identity.role for identity in done.identities]
    counts = ", ".join(f"{roles.count(role)} {role}" for role in dict.fromkeys(roles))
    accounts = (args.out / NATS_ACCOUNTS_FILE).resolve()
    print(f"laneway bus provision: users for {counts} in {args.out}")
    print(f"  NATS: include {accounts} in nats-server's configuration (`include` takes a path")
    print("        from the configuration's folder) and reload it (nats-server --signal reload)")
    print(f"  etcd: {done.etcd}")
    print(
        "  then: laneway up --nats-url nats://HOST:PORT --etcd-endpoints HOST:PORT "
        f"--bus-credentials {args.out}"
    )
    if args.k8s_secrets is not None:
        print(f"  Kubernetes: kubectl apply -f {args.k8s_secrets} (Secrets laneway-bus-<role>)")
    return 0


def _streams(args: argparse.Namespace) -> int:
    folder = Provisioned(args.bus_credentials.resolve())
    nats_url = args.nats_url or os.environ.get("LANEWAY_NATS_URL")
    if not nats_url:
        raise SystemExit("laneway bus streams: give --nats-url (or LANEWAY_NATS_URL)")
    workers = [identity for identity in folder.identities() if identity.role == "worker"]
    asyncio.run(make_streams(folder, nats_url, workers))
    print(f"laneway bus streams: the streams and {len(workers)} workers' durables are made")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bus = sub.add_parser("bus", help="NATS and etcd users for servers you run yourself")
    commands = bus.add_subparsers(dest="bus_command", required=True)
    prov = commands.add_parser(
        "provision",
        help="a user per service with only what it needs: NATS accounts to include, etcd users "
        "made, each service's credentials written (see docs/operations.md)",
    )
    prov.add_argument("--out", type=Path, required=True, help="folder for the credentials")
    prov.add_argument(
        "--etcd-endpoints",
        help="etcd (host:port) to make the users on, as its root (LANEWAY_ETCD_USER and "
        "LANEWAY_ETCD_PASSWORD, or root:PASSWORD@host:port); left out: NATS users only",
    )
    prov.add_argument(
        "--workers",
        type=at_least(1),
        default=16,
        help="unspent worker users to hold: each worker start, restarts included, spends one",
    )
    prov.add_argument("--ingresses", type=at_least(1), default=1, help="ingress users")
    prov.add_argument("--kv-indexers", type=at_least(1), default=1, help="kv-indexer users")
    prov.add_argument(
        "--k8s-secrets",
        type=Path,
        metavar="FILE",
        help="also write the users as Kubernetes Secrets here (one per role, and the NATS "
        "accounts), for deploy/k8s/overlays/gpu",
    )
    prov.set_defaults(func=_provision)
    streams = commands.add_parser(
        "streams",
        help="make the streams and every provisioned worker's durable, as the folder's admin "
        "(after nats-server took the users): what no service's own user may",
    )
    streams.add_argument(
        "--bus-credentials",
        type=Path,
        required=True,
        metavar="DIR",
        help="the folder of `laneway bus provision` (its admin's credentials and worker users)",
    )
    streams.add_argument("--nats-url", help="the NATS servers (default: LANEWAY_NATS_URL)")
    streams.set_defaults(func=_streams)
