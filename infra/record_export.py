"""`laneway record export`: a time window of a running cluster's log into one recording file."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bus.settings import ServiceSettings
from infra.recording import RecordingError, Window, read_log, write_recording

RELATIVE_TIME = re.compile(r"^-(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise) or one relative to now: ``-5m``, ``-2h``."""
    relative = RELATIVE_TIME.match(text.strip())
    if relative:
        ago = float(relative.group(1)) * _UNIT_S[relative.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=ago)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise RecordingError(
            f"{text!r} is not a time: give ISO 8601 (2026-12-01T08:00:00Z) or -5m, -2h, -1d"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    record = sub.add_parser("record", help="recordings of a cluster's log")
    actions = record.add_subparsers(dest="record_command", required=True)
    export = actions.add_parser(
        "export",
        help="write a time window of the log (requests, routes, KV, load, control) to a file",
    )
    # `--since -5m` is a value, not an option: argparse takes what matches this for a number.
    export._negative_number_matcher = RELATIVE_TIME
    export.add_argument(
        "--nats-url",
        default=ServiceSettings().nats_url,
        help="the cluster's NATS (LANEWAY_NATS_URL)",
    )
    export.add_argument(
        "--since",
        help="from this time: ISO 8601 or relative (-5m, -2h), and the planners' settings from "
        "before it (replay needs them); default: all the log",
    )
    export.add_argument("--until", help="up to this time, as --since; default: now")
    export.add_argument(
        "--redact",
        action="store_true",
        help="leave out prompt text (token ids); keep token counts and block hashes",
    )
    export.add_argument(
        "-o", "--output", type=Path, required=True, help="recording to write (.gz: compressed)"
    )
    export.set_defaults(func=export_main)


def export_main(args: argparse.Namespace) -> int:
    window = Window(
        since=parse_time(args.since) if args.since else None,
        until=parse_time(args.until) if args.until else None,
    )
    if window.since is not None and window.until is not None and window.since > window.until:
        raise RecordingError(
            f"--since {args.since} comes after --until {args.until}: an empty window"
        )
    recorded = asyncio.run(read_log(args.nats_url, window.since, window.until))
    try:
        write_recording(args.output, recorded, args.redact, window)
    except OSError as err:
        raise RecordingError(f"{args.output}: cannot be written ({err.strerror})") from None
    kinds = Counter(r.event.type for r in recorded)
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    print(f"wrote {len(recorded)} messages to {args.output}: {summary or 'none'}", file=sys.stderr)
    return 0
