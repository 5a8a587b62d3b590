"""A cluster's log, from a recording file or straight from JetStream, indexed by request in one
pass: what `laneway explain` and `laneway replay` read."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from nats.errors import Error as NatsError

from infra.recording import Recorded, RecordingError, read_log, read_recording
from schemas.events import (
    CancellationRequested,
    KvTransferred,
    PlannerConfigured,
    PrefillCompleted,
    RequestAccepted,
    RouteDecided,
    TerminalEvent,
)

# The fewest leading characters of an id that find its request.
MIN_PREFIX = 6
# The prefixes the OpenAI API puts before a request id; an operator pastes ids with them.
_ID_PREFIXES = ("chatcmpl-", "cmpl-")


def bare_id(request_id: str) -> str:
    """The request id without the prefix the OpenAI API puts before it."""
    for prefix in _ID_PREFIXES:
        request_id = request_id.removeprefix(prefix)
    return request_id


@dataclass(slots=True)
class RequestLog:
    """What the log holds of one request."""

    request_id: str
    accepted: RequestAccepted | None = None
    # Its decision (a remote prefill's copy to the prefill worker is the same decision).
    route: RouteDecided | None = None
    prefill_completed: list[PrefillCompleted] = field(default_factory=list)
    transferred: list[KvTransferred] = field(default_factory=list)
    cancel_requested: CancellationRequested | None = None
    terminal: TerminalEvent | None = None


@dataclass(slots=True)
class LogIndex:
    # What was read, as it was read.
    recorded: list[Recorded]
    requests: dict[str, RequestLog] = field(default_factory=dict)
    # Each planner replica's settings, by source, in the order they were recorded.
    configs: dict[str, list[PlannerConfigured]] = field(default_factory=dict)

    def find(self, request_id: str) -> RequestLog | None:
        """The request with this id (the API's ``cmpl-`` prefix allowed), or the one request
        whose id starts with it."""
        request_id = bare_id(request_id)
        found = self.requests.get(request_id)
        if found is not None:
            return found
        matches = [log for rid, log in self.requests.items() if rid.startswith(request_id)]
        return matches[0] if len(matches) == 1 and len(request_id) >= MIN_PREFIX else None

    def starting_with(self, request_id: str) -> int:
        """How many requests' ids start with ``request_id`` (the API's prefix allowed)."""
        request_id = bare_id(request_id)
        return sum(1 for rid in self.requests if rid.startswith(request_id))

    def config_of(self, route: RouteDecided) -> PlannerConfigured | None:
        """The settings its replica had when it decided: the last it recorded by then."""
        configs = self.configs.get(route.source, [])
        before = [c for c in configs if c.occurred_at <= route.occurred_at]
        return before[-1] if before else (configs[0] if configs else None)

    def routed(self) -> list[RequestLog]:
        """The requests a planner decided, in the order it decided them."""
        logs = [log for log in self.requests.values() if log.route is not None]
        return sorted(logs, key=lambda log: _decided_at(log))


def _decided_at(log: RequestLog) -> datetime:
    assert log.route is not None
    return log.route.occurred_at


def index(recorded: list[Recorded]) -> LogIndex:
    out = LogIndex(recorded)
    for item in recorded:
        event = item.event
        if isinstance(event, PlannerConfigured):
            out.configs.setdefault(event.source, []).append(event)
            continue
        if event.request_id is None:
            continue
        log = out.requests.get(event.request_id)
        if log is None:
            log = out.requests[event.request_id] = RequestLog(event.request_id)
        if isinstance(event, RequestAccepted):
            log.accepted = event
        elif isinstance(event, RouteDecided):
            log.route = log.route or event
        elif isinstance(event, PrefillCompleted):
            log.prefill_completed.append(event)
        elif isinstance(event, KvTransferred):
            log.transferred.append(event)
        elif isinstance(event, CancellationRequested):
            log.cancel_requested = event
        elif isinstance(event, TerminalEvent):
            log.terminal = event
    for configs in out.configs.values():
        configs.sort(key=lambda c: c.occurred_at)
    return out


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recording", nargs="?", type=Path, help="a recording (`laneway record export`)"
    )
    parser.add_argument("--nats-url", help="read the live cluster's log from this NATS instead")


def load(args: argparse.Namespace, *mentioning: str) -> LogIndex:
    """The log the command line names; RecordingError (one line) when it cannot be read.

    ``mentioning``: of a recording, only the messages whose line holds one of these strings (and
    the planners' settings) need decoding; the others are left out of the index.
    """
    if (args.recording is None) == (args.nats_url is None):
        raise RecordingError("give a RECORDING or --nats-url URL (one of them)")
    if args.recording is not None:
        needles = [m.encode() for m in mentioning]
        if needles:
            needles.append(b'"PlannerConfigured"')

        def keep(line: bytes) -> bool:
            return any(needle in line for needle in needles)

        return index(read_recording(args.recording, keep if needles else None))
    try:
        return index(asyncio.run(read_log(args.nats_url, None, None)))
    except (OSError, TimeoutError, NatsError) as err:
        cause = str(err) or type(err).__name__
        raise RecordingError(f"cannot read the log at {args.nats_url}: {cause}") from None
