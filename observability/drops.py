"""Warnings that someone else can cause at will, kept from flooding the log: a message dropped as
forged, malformed or undecodable, a record of etcd ignored. One warning per dropped message let a
worker's own credentials write 10.9 MB into the ingress's log in 6.5 s.

Each such warning is logged at most once per reason per interval (10 s), and the first after a
quiet spell says how many were left out since; every dropped message is counted in
``laneway_bus_dropped_events_total{reason}``, which each service's metrics registry includes
(:func:`count_drops_in`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

# How often one reason may be logged, seconds.
LOG_INTERVAL_S = 10.0

# One per process, counted whichever bus or fold dropped the message; in no registry of its own,
# so that each service's registry (several in a test process) can take it in.
DROPPED = Counter(
    "laneway_bus_dropped_events",
    "Messages dropped unhandled, by reason: undecodable, impostor (names another publisher than "
    "its subject's), stray (an event type its channel does not carry), implausible_seq (a KV "
    "event's seq past its stream position), not_placed_worker (an answer or hand-off from "
    "another worker than the one its request's route named), malformed_query, not_an_inbox (a "
    "query whose reply subject is no inbox: its answer would be written there), not_a_delivery "
    "(a message on a durable's deliver subject that is not one of its deliveries).",
    ["reason"],
    registry=None,
)


def count_drops_in(registry: CollectorRegistry) -> None:
    """Expose this process's dropped-message counts in ``registry`` (a service's metrics)."""
    registry.register(DROPPED)


class RateLimitedLog:
    """Warnings through ``logger``, at most one per reason every ``interval_s``; the next one
    logged says how many of that reason were left out since. Reasons are a few fixed names, so
    what is kept per reason stays small."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def warning(self, reason: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``reason`` was logged less than the interval ago; whether
        it was logged."""
        now = self._clock()
        if now < self._next.get(reason, now):
            self._left_out[reason] = self._left_out.get(reason, 0) + 1
            return False
        self._next[reason] = now + self._interval_s
        left_out = self._left_out.pop(reason, 0)
        if left_out:
            msg += " (and %d more such since the last one logged)"
            args = (*args, left_out)
        self._logger.warning(msg, *args)
        return True


class Drops:
    """A module's dropped messages: each counted by reason, logged rate-limited."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self._log = RateLimitedLog(logger, interval_s)

    def __call__(self, reason: str, msg: str, *args: object) -> None:
        DROPPED.labels(reason).inc()
        self._log.warning(reason, msg, *args)


def first_line(error: BaseException, limit: int = 200) -> str:
    """An error's message in one bounded line: a pydantic error quotes the input it refused, which
    a sender picks, over several lines."""
    lines = str(error).splitlines()
    return (lines[0] if lines else type(error).__name__)[:limit]
