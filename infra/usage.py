"""`laneway usage`: each tenant's requests and tokens over a window of a cluster's log, per model.

Summed from the requests' terminal events, which carry their tenant and model: a finished one's
``usage`` is what its client was told; a cancelled one (the client left, or its stream was cut)
is charged its prompt and the tokens generated before the stop. A failed request is charged
nothing. The log holds what its streams' retention keeps (docs/operations.md): for a longer
record, export it (`laneway record export`) while it is there.

The cluster is found as `laneway keys` finds it: ``--nats-url`` (or ``$LANEWAY_NATS_URL``), else
the `laneway up` running on ``--state-dir``, with its admin's credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra import up_processes
from infra.record_export import RELATIVE_TIME, parse_time
from infra.recording import RecordingError, read_log
from schemas.events import Event, RequestCancelled, RequestFinished

# A request of a cluster that takes no keys has no tenant; no tenant's name can be this.
NO_TENANT = "-"
_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


def tally(events: Iterable[Event], tenant: str | None = None) -> dict[str, Any]:
    """``{"tenants": {NAME: {requests, prompt_tokens, cached_tokens, completion_tokens,
    "models": {MODEL: the same}}}}`` of the terminal events among ``events``, each request
    counted once (its first terminal event), of ``tenant`` alone where one is given."""
    seen: set[str] = set()
    tenants: dict[str, dict[str, Any]] = {}
    for event in events:
        if not isinstance(event, RequestFinished | RequestCancelled) or event.request_id is None:
            continue
        if event.request_id in seen:
            continue
        seen.add(event.request_id)
        name = event.tenant or NO_TENANT
        if tenant is not None and name != tenant:
            continue
        counts: tuple[int, int, int, int]
        if isinstance(event, RequestFinished):
            used = event.usage
            counts = (1, used.prompt_tokens, used.cached_tokens, used.completion_tokens)
        else:
            counts = (1, event.prompt_tokens, event.cached_tokens, event.completion_tokens)
        entry = tenants.setdefault(name, {**dict.fromkeys(_FIELDS, 0), "models": {}})
        model = entry["models"].setdefault(event.model or NO_TENANT, dict.fromkeys(_FIELDS, 0))
        for field, count in zip(_FIELDS, counts, strict=True):
            entry[field] += count
            model[field] += count
    return {"tenants": dict(sorted(tenants.items()))}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    usage = sub.add_parser(
        "usage", help="requests and tokens per tenant and model, from the cluster's log"
    )
    # `--since -5m` is a value, not an option: argparse takes what matches this for a number.
    usage._negative_number_matcher = RELATIVE_TIME
    usage.add_argument("--since", help="from this time: ISO 8601 or relative (-5m, -2h)")
    usage.add_argument("--until", help="up to this time, as --since; default: now")
    usage.add_argument("--tenant", help="this tenant's alone")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    usage.add_argument("--nats-url", help="the cluster's NATS (default: $LANEWAY_NATS_URL)")
    usage.add_argument(
        "--state-dir",
        type=Path,
        default=Path(".state"),
        help="the state dir of the `laneway up` whose usage this is, when no NATS is given",
    )
    usage.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    nats_url = args.nats_url or os.environ.get("LANEWAY_NATS_URL")
    if not nats_url:
        found = up_processes.urls(up_processes.processes(args.state_dir))
        if found is None:
            print(
                f"laneway usage: no laneway up runs on {args.state_dir}: pass --state-dir or "
                "--nats-url",
                file=sys.stderr,
            )
            return 2
        nats_url = found[0]
    since = parse_time(args.since) if args.since else None
    until = parse_time(args.until) if args.until else None
    try:
        recorded = asyncio.run(read_log(nats_url, since, until, outcomes_only=True))
    except RecordingError as err:
        print(f"laneway usage: {err}", file=sys.stderr)
        return 1
    totals = tally((r.event for r in recorded), args.tenant)
    if args.json:
        print(json.dumps(totals, indent=2))
        return 0
    print(f"{'tenant':<24} {'model':<24} " + " ".join(f"{f:>17}" for f in _FIELDS))
    for name, entry in totals["tenants"].items():
        for model, counts in entry["models"].items():
            print(f"{name:<24} {model:<24} " + " ".join(f"{counts[f]:>17}" for f in _FIELDS))
    return 0
