"""Keeps a running cluster's children up: a child that exits (crashed, killed, or stopped by
someone other than ``laneway up``) is started again after a backoff, on the same ports and data,
with one log line per restart; past a restart budget the supervisor gives up and says which child
and why, so that ``laneway up`` can exit non-zero instead of serving a cluster that is not whole.

The supervisor spawns from the thread that runs it: the children's die-with-parent signal is
tied to that thread (``infra.embedded.die_with_parent``), so run it on the main thread, or on a
thread that lives as long as the cluster."""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from infra.startup import log_cause

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff doubles from ``first_backoff_s`` with each death in the last ``window_s``, up to
    ``max_backoff_s``; more than ``budget`` deaths of one child in the window is giving up."""

    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    budget: int = 5
    window_s: float = 120.0


@dataclass
class RestartTracker:
    """When one child may start again, from when it died before (pure: the caller's clock)."""

    policy: RestartPolicy
    deaths: list[float] = field(default_factory=list)

    def died(self, now: float) -> float | None:
        """The delay before the restart of a child that died at ``now``; None past the budget."""
        self.deaths = [t for t in self.deaths if now - t < self.policy.window_s] + [now]
        if len(self.deaths) > self.policy.budget:
            return None
        return min(
            self.policy.max_backoff_s,
            self.policy.first_backoff_s * 2.0 ** (len(self.deaths) - 1),
        )

    @property
    def restarts(self) -> int:
        return len(self.deaths)


class Child(Protocol):
    """A supervised process: an embedded server or a service."""

    @property
    def name(self) -> str: ...

    @property
    def proc(self) -> subprocess.Popen[bytes] | None: ...

    @property
    def log_file(self) -> Path | None: ...


class GaveUp(RuntimeError):
    """A child kept dying past its restart budget; the message is one line for the user."""


@dataclass
class _Pending:
    child: Child
    due: float


class Supervisor:
    def __init__(
        self,
        children: Callable[[], Sequence[Child]],
        respawn: Callable[[Child], None],
        policy: RestartPolicy | None = None,
        poll_s: float = 0.2,
    ) -> None:
        """``children``: what to watch, servers first (they are restarted before the services
        that use them); ``respawn``: starts one again, as it was started."""
        self._children = children
        self._respawn = respawn
        self._policy = policy or RestartPolicy()
        self._poll_s = poll_s
        self._trackers: dict[str, RestartTracker] = {}
        self._pending: dict[str, _Pending] = {}

    def run(self, stop: threading.Event) -> None:
        """Watch until ``stop`` is set; raises ``GaveUp`` when a child cannot be kept up."""
        while not stop.wait(self._poll_s):
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for child in self._children():
            proc = child.proc
            if proc is None:
                continue
            if child.name not in self._pending and proc.poll() is not None:
                self._schedule(child, proc.returncode, now)
        for name, pending in list(self._pending.items()):
            if pending.due <= now:
                del self._pending[name]
                self._respawn(pending.child)

    def _schedule(self, child: Child, code: int, now: float) -> None:
        tracker = self._trackers.setdefault(child.name, RestartTracker(self._policy))
        delay = tracker.died(now)
        cause = _cause(child, code)
        if delay is None:
            raise GaveUp(
                f"{child.name} exited {tracker.restarts} times within "
                f"{self._policy.window_s:.0f}s; giving up (last: {cause}; "
                f"log: {child.log_file})"
            )
        logger.warning(
            "%s exited (%s); restart %d of %d in %.1fs",
            child.name,
            cause,
            tracker.restarts,
            self._policy.budget,
            delay,
        )
        self._pending[child.name] = _Pending(child, now + delay)


def _cause(child: Child, code: int) -> str:
    # Killed by a signal, the last thing it logged is no cause (a server's "ready", say).
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    if code == 0:
        return "exit code 0"  # it stopped as asked (a SIGTERM from outside, say)
    logged = log_cause(child.log_file) if child.log_file else None
    return f"exit code {code}: {logged or 'no output'}"
