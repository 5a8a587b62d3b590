"""``laneway keys create|list|revoke``: the API keys of a cluster, in its etcd (``bus.api_keys``).

Without ``--etcd-endpoints`` (or ``$LANEWAY_ETCD_ENDPOINTS``), the etcd is that of the
`laneway up` running on ``--state-dir``, read from the environment of one of its services.
``create`` prints the new key alone on its last line (``KEY=$(laneway keys create … | tail -1)``);
it is shown once and stored only as its SHA-256.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar, get_args

import aetcd

from bus.api_keys import (
    KEY_ID_PATTERN,
    KEY_PREFIX,
    SCOPES,
    TENANT_PATTERN,
    ApiKeyRecord,
    KeyPriority,
    Scope,
    create_key,
    list_keys,
    revoke_key,
    revoke_startup_keys,
)
from bus.credentials import split_credentials
from bus.registry import connect_etcd
from infra import up_processes
from schemas.events import utc_now

T = TypeVar("T")
# The tenant of the key `laneway up` makes for its own run.
STARTUP_TENANT = "local"
# Where that key is kept in the state dir (0600) while the run lasts, for the tools and
# benchmarks of the same user (``read_startup_key``).
STARTUP_KEY_FILE = "api-key"
# A key is 46 characters; a larger file is not ours.
_MAX_KEY_FILE_BYTES = 256


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke the API keys of a cluster")
    commands = keys.add_subparsers(dest="keys_command", required=True)
    create = commands.add_parser("create", help="make a key for a tenant; prints it last")
    create.add_argument("--tenant", required=True, help="whose key it is (letters, digits, _.-)")
    create.add_argument("--rate", type=float, help="the tenant's requests per second")
    create.add_argument("--max-concurrency", type=int, help="the tenant's requests at once")
    create.add_argument(
        "--weight",
        type=float,
        default=1.0,
        help="the tenant's share of the cluster when tenants contend for it, against the "
        "others' weights (default 1)",
    )
    create.add_argument(
        "--tokens-per-minute",
        type=int,
        metavar="N",
        help="the tenant's prompt plus completion tokens a minute",
    )
    create.add_argument("--tokens-per-day", type=int, metavar="N", help="the same, over a day")
    create.add_argument(
        "--max-priority",
        choices=get_args(KeyPriority),
        default="normal",
        help="the highest admission priority (x-laneway-priority) the tenant's requests get",
    )
    create.add_argument(
        "--expires-in",
        type=_duration,
        metavar="DURATION",
        help="refused after this long: seconds, or a number with s, m, h or d (90d); default: "
        "until revoked",
    )
    create.add_argument(
        "--cache-group",
        metavar="TENANT",
        help="share the prefix cache of this tenant's group (the keys made with the same "
        "--cache-group, or for that tenant without one): for tenants that trust each other; "
        "default: the key's own tenant's",
    )
    create.add_argument(
        "--scope",
        action="append",
        choices=SCOPES,
        help="what the key may do, repeatable (default: inference; metrics: /metrics where "
        "LANEWAY_METRICS_AUTH keys it; admin: load and unload LoRA adapters)",
    )
    create.set_defaults(func=_create)
    listing = commands.add_parser("list", help="every key's id, tenant and limits (not the key)")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(func=_list)
    revoke = commands.add_parser("revoke", help="delete a key; the API refuses it within a second")
    revoke.add_argument("key_id", help="the key's id, as `laneway keys list` shows it")
    revoke.set_defaults(func=_revoke)
    for command in (create, listing, revoke):
        command.add_argument(
            "--etcd-endpoints",
            help="etcd endpoints (host:port), comma-separated (default: $LANEWAY_ETCD_ENDPOINTS)",
        )
        command.add_argument(
            "--state-dir",
            type=Path,
            default=Path(".state"),
            help="the state dir of the `laneway up` whose keys these are, when no etcd is given",
        )


def _create(args: argparse.Namespace) -> int:
    if not re.fullmatch(TENANT_PATTERN, args.tenant):
        return _fail(
            f"--tenant {args.tenant[:70]!r}: 1-64 letters, digits, '_', '.' or '-' "
            "(a letter or digit first)"
        )
    if args.cache_group is not None and not re.fullmatch(TENANT_PATTERN, args.cache_group):
        return _fail(f"--cache-group {args.cache_group[:70]!r}: a tenant's name, as --tenant")
    if args.rate is not None and not 0 < args.rate < math.inf:
        return _fail("--rate must be a positive number (leave it out for any rate)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        return _fail("--max-concurrency must be at least 1")
    if not 0 < args.weight <= 1000:
        return _fail("--weight must be above 0 and at most 1000")
    for flag, value in (
        ("--tokens-per-minute", args.tokens_per_minute),
        ("--tokens-per-day", args.tokens_per_day),
    ):
        if value is not None and value < 1:
            return _fail(f"{flag} must be at least 1")
    record, key = _run(
        args,
        lambda etcd: create_key(
            etcd,
            args.tenant,
            rate_per_s=args.rate,
            max_concurrency=args.max_concurrency,
            weight=args.weight,
            tokens_per_minute=args.tokens_per_minute,
            tokens_per_day=args.tokens_per_day,
            scopes=tuple(dict.fromkeys(args.scope or ["inference"])),
            max_priority=args.max_priority,
            expires_in_s=args.expires_in,
            cache_group=args.cache_group,
        ),
    )
    expires = "" if record.expires_at is None else f", expires {record.expires_at:{_TIME}}"
    group = "" if record.cache_group is None else f", cache group {record.cache_group}"
    print(
        f"created key {record.key_id} for tenant {record.tenant} "
        f"({_limits(record)}{expires}{group})"
    )
    print(key)
    return 0


def _list(args: argparse.Namespace) -> int:
    records = _run(args, list_keys)
    if args.json:
        # Neither the key's hash nor its cache group's secret leaves etcd.
        hidden = {"sha256", "cache_secret"}
        print(json.dumps([r.model_dump(mode="json", exclude=hidden) for r in records]))
        return 0
    rows = [
        (
            "KEY ID",
            "TENANT",
            "LIMITS",
            "SCOPES",
            "MAX PRIORITY",
            "CACHE GROUP",
            "CREATED",
            "EXPIRES",
        )
    ]
    now = utc_now()
    rows += [
        (
            r.key_id,
            r.tenant + (" (laneway up)" if r.startup else ""),
            _limits(r),
            ",".join(r.scopes),
            r.max_priority,
            r.group,
            r.created_at.strftime(_TIME),
            "never"
            if r.expires_at is None
            else r.expires_at.strftime(_TIME) + (" (expired)" if r.expired(now) else ""),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


def _revoke(args: argparse.Namespace) -> int:
    if not re.fullmatch(KEY_ID_PATTERN, args.key_id):
        return _fail(f"not a key id: {args.key_id[:40]!r} (16 hex digits, as `keys list` shows)")
    revoked = _run(args, lambda etcd: revoke_key(etcd, args.key_id))
    if not revoked:
        return _fail(f"no key {args.key_id}")
    print(f"revoked key {args.key_id}")
    return 0


def startup_key(etcd_endpoints: str, state_dir: Path) -> str:
    """The key `laneway up` prints: a new one each start, those of earlier starts revoked; also
    written to ``STARTUP_KEY_FILE`` in the state dir, readable by its owner only."""

    async def make(etcd: aetcd.Client) -> str:
        await revoke_startup_keys(etcd)
        # The operator's own key: it loads the cluster's LoRA adapters too.
        scopes: tuple[Scope, ...] = ("inference", "admin")
        return (await create_key(etcd, STARTUP_TENANT, scopes=scopes, startup=True))[1]

    key = _in_thread(etcd_endpoints, make)
    path = state_dir / STARTUP_KEY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(key + "\n")
    tmp.replace(path)
    return key


def read_startup_key(state_dir: Path) -> str | None:
    """The key of the `laneway up` running on ``state_dir``; None where it takes no keys."""
    try:
        with open(state_dir / STARTUP_KEY_FILE, "rb") as file:
            raw = file.read(_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    key = raw.decode(errors="replace").strip()
    if len(raw) > _MAX_KEY_FILE_BYTES or not key.startswith(KEY_PREFIX):
        raise ValueError(f"{state_dir / STARTUP_KEY_FILE} holds no API key")
    return key


_TIME = "%Y-%m-%d %H:%M:%S UTC"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_LONGEST_S = 36_500 * _UNITS["d"]


def _duration(text: str) -> float:
    """``--expires-in``: seconds, or a positive number with a unit."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if found is None or float(found[1]) <= 0:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text[:40]!r} (e.g. 3600, 45m, 12h, 90d)"
        )
    seconds = float(found[1]) * _UNITS[found[2] or "s"]
    if seconds > _LONGEST_S:  # past it, the expiry date itself would not exist
        raise argparse.ArgumentTypeError(
            f"at most {_LONGEST_S // _UNITS['d']}d; a key meant to last leaves --expires-in out"
        )
    return seconds


def _limits(record: ApiKeyRecord) -> str:
    rate = "any rate" if record.rate_per_s is None else f"{record.rate_per_s:g}/s"
    at_once = "any" if record.max_concurrency is None else str(record.max_concurrency)
    limits = [rate, f"{at_once} at once", f"weight {record.weight:g}"]
    if record.tokens_per_minute is not None:
        limits.append(f"{record.tokens_per_minute} tokens/min")
    if record.tokens_per_day is not None:
        limits.append(f"{record.tokens_per_day} tokens/day")
    return ", ".join(limits)


def _fail(message: str) -> int:
    print(f"laneway keys: {message}", file=sys.stderr)
    return 2


def _endpoints(args: argparse.Namespace) -> str:
    given = args.etcd_endpoints or os.environ.get("LANEWAY_ETCD_ENDPOINTS")
    if given:
        return str(given)
    found = up_processes.urls(up_processes.processes(args.state_dir))
    if found is None:
        raise SystemExit(
            _fail(f"no laneway up runs on {args.state_dir}: pass --state-dir or --etcd-endpoints")
        )
    return found[1]


def _run(args: argparse.Namespace, call: Callable[[aetcd.Client], Awaitable[T]]) -> T:
    return _in_thread(_endpoints(args), call)


def _in_thread(endpoints: str, call: Callable[[aetcd.Client], Awaitable[T]]) -> T:
    async def run() -> T:
        etcd = connect_etcd(endpoints)
        try:
            return await call(etcd)
        except aetcd.ClientError as exc:
            # Not there, or refusing this user: one line naming the endpoints (no password).
            shown = split_credentials(endpoints)[1]
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise SystemExit(_fail(f"etcd at {shown} refused or did not answer: {cause}")) from None
        finally:
            await etcd.close()

    # A thread of its own, so that this also works when the caller runs an event loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()
