"""`laneway serve SERVICE`: one service in this process, for a host of its own, a systemd unit or
a container, against the NATS and etcd the operator runs.

Everything a service reads is a ``LANEWAY_*`` setting (what deploy/k8s passes); the flags here
set the ones each host differs in. With ``--bus-credentials`` (the folder of `laneway bus
provision`, or a copy of it on each host), the service runs as a user of its own: a worker,
ingress or kv-indexer claims a user of its role no process took before (``infra.provisioned``),
or takes the one ``--id`` names; the planner's replicas share theirs. Where the folder has the
admin's credentials, the streams, the bucket and a worker's durable are made as the admin
first, as `laneway up` does; a folder without them (a host given only its services' users)
leaves that to `laneway bus streams`.

The service replaces this process (``exec``): its signals, exit code and readiness
(``/readyz`` on ``--metrics-port``) are the service's own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bus.credentials import ETCD_CREDS_ENV, NATS_CREDS_ENV, split_credentials
from bus.permissions import Identity, Role
from infra.arg_types import port
from infra.provisioned import NoIdentityLeft, Provisioned, make_streams

# Each service's module, and the role flag's worker modules.
MODULES = {
    "ingress": "services.ingress",
    "planner": "services.planner",
    "kv-indexer": "services.kv_indexer",
}
WORKER_MODULES = {
    "both": "services.worker.decode_worker",
    "decode": "services.worker.decode_worker",
    "prefill": "services.worker.prefill_worker",
}


def service_env(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """The settings the flags give, over ``environ``'s; SystemExit naming what is missing."""
    env: dict[str, str] = {}
    for flag, variable in (
        ("nats_url", "LANEWAY_NATS_URL"),
        ("etcd_endpoints", "LANEWAY_ETCD_ENDPOINTS"),
        ("metrics_host", "LANEWAY_METRICS_HOST"),
        ("metrics_port", "LANEWAY_METRICS_PORT"),
        ("host", "LANEWAY_HOST"),
        ("port", "LANEWAY_PORT"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            env[variable] = str(value)
    for variable in ("LANEWAY_NATS_URL", "LANEWAY_ETCD_ENDPOINTS"):
        if variable not in env and variable not in environ:
            flag = "--" + variable.removeprefix("LANEWAY_").lower().replace("_", "-")
            raise SystemExit(f"laneway serve: give {flag} (or {variable})")
    if args.service == "worker":
        if args.role == "both":
            env["LANEWAY_ROLE"] = "both"
        if args.id:
            env["LANEWAY_WORKER_ID"] = args.id
    elif args.id:
        env["LANEWAY_INSTANCE_ID"] = args.id
    if args.service == "ingress":
        # As `laneway up`'s: every request needs a key (`laneway keys create`) unless asked.
        on = "false" if args.no_auth else environ.get("LANEWAY_API_AUTH", "true")
        env["LANEWAY_API_AUTH"] = on
    if args.bus_credentials is not None:
        etcd = env.get("LANEWAY_ETCD_ENDPOINTS") or environ["LANEWAY_ETCD_ENDPOINTS"]
        nats = env.get("LANEWAY_NATS_URL") or environ["LANEWAY_NATS_URL"]
        env.update(_provisioned_env(args, Provisioned(args.bus_credentials.resolve()), nats, etcd))
    return env


def _provisioned_env(
    args: argparse.Namespace, folder: Provisioned, nats_url: str, etcd_endpoints: str
) -> dict[str, str]:
    """The service's identity from the folder, the paths of its credentials, and, where the
    folder holds the admin's, what the admin makes made."""
    try:
        folder.check()
        identity = asyncio.run(_identity(args, folder, etcd_endpoints))
    except NoIdentityLeft as exc:
        raise SystemExit(f"laneway serve: {exc}") from None
    env = {
        NATS_CREDS_ENV: str(folder.path("nats", identity.user)),
        "LANEWAY_BUS_PROVISIONED": "true",
    }
    if "etcd" in folder.servers():
        env[ETCD_CREDS_ENV] = str(folder.path("etcd", identity.user))
    if identity.role == "worker":
        env["LANEWAY_WORKER_ID"] = identity.instance
    elif identity.instance:
        env["LANEWAY_INSTANCE_ID"] = identity.instance
    if folder.path("nats", "admin").exists():
        workers = [identity] if identity.role == "worker" else []
        asyncio.run(make_streams(folder, nats_url, workers))
    return env


async def _identity(args: argparse.Namespace, folder: Provisioned, etcd: str) -> Identity:
    role: Role = args.service
    if role == "planner":
        return Identity("planner")
    if not args.id:
        return await folder.claim(role, etcd, set())
    wanted = Identity(role, args.id)
    if wanted not in folder.identities():
        raise NoIdentityLeft(f"{folder.folder} has no user {wanted.user}")
    return wanted


def _serve(args: argparse.Namespace) -> int:
    env = service_env(args, dict(os.environ))
    module = WORKER_MODULES[args.role] if args.service == "worker" else MODULES[args.service]
    # What it runs with, never a password: the servers' addresses without their credentials.
    shown = {
        k: split_credentials(v)[1] if k.endswith(("_URL", "_ENDPOINTS")) else v
        for k, v in sorted(env.items())
    }
    print(f"laneway serve: {module}, " + " ".join(f"{k}={v}" for k, v in shown.items()))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module], {**os.environ, **env})


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="run one service in this process, against your NATS and etcd (docs/operations.md)",
    )
    serve.add_argument("service", choices=[*MODULES, "worker"], help="the service to run")
    serve.add_argument(
        "--role",
        choices=list(WORKER_MODULES),
        default="both",
        help="worker: serve requests end to end (both), or be a prefill or decode worker of a "
        "disaggregated pair",
    )
    serve.add_argument("--nats-url", help="the NATS servers (default: LANEWAY_NATS_URL)")
    serve.add_argument(
        "--etcd-endpoints", help="the etcd members, host:port (default: LANEWAY_ETCD_ENDPOINTS)"
    )
    serve.add_argument(
        "--bus-credentials",
        type=Path,
        metavar="DIR",
        help="the folder of `laneway bus provision`: run as a user of its own there (default: "
        "the credentials the URL or the LANEWAY_* settings give)",
    )
    serve.add_argument(
        "--id",
        help="the instance id (a worker's id); default: with --bus-credentials, a user of the "
        "service's role that no process took, claimed in etcd; else a fresh id",
    )
    serve.add_argument(
        "--no-auth",
        action="store_true",
        help="ingress: take requests without a key (by default it needs one: `laneway keys`)",
    )
    serve.add_argument("--host", help="ingress: HTTP bind address (default: LANEWAY_HOST)")
    serve.add_argument("--port", type=port, help="ingress: HTTP port (default: LANEWAY_PORT)")
    serve.add_argument(
        "--metrics-host", help="/metrics, /healthz and /readyz bind address (LANEWAY_METRICS_HOST)"
    )
    serve.add_argument(
        "--metrics-port", type=port, help="their port (default: LANEWAY_METRICS_PORT, else none)"
    )
    serve.set_defaults(func=_serve)
