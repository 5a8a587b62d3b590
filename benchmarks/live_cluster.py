"""`laneway up` as a benchmark's child: started on free ports in a state dir of its own, its
URL and service pids read from what it prints, its API key and the admin's NATS credentials from
the files it names (it prints no secret), stopped as Ctrl-C would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bus.credentials import Credentials
from infra.cluster_auth import admin_files
from infra.keys import read_startup_key
from infra.ports import free_port

_SERVING = re.compile(r"serving the OpenAI API at (\S+)")
_PID = re.compile(r"^  (\S+)(?: \(embedded\))?\s+pid (\d+)$")
_NATS = re.compile(r"^  NATS (\S+)")


@dataclass
class RunningUp:
    base_url: str
    api_key: str | None
    nats_url: str
    state_dir: Path
    # Service name (nats and etcd for the embedded servers) to pid.
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"


def _read_banner(proc: subprocess.Popen[str]) -> tuple[RunningUp | None, str]:
    """Up to the banner's last line ('logs: …'), or what it printed before it gave up (it
    bounds its own start-up)."""
    assert proc.stdout is not None
    seen: list[str] = []
    url = nats = None
    pids: dict[str, int] = {}
    # `laneway up` prints its banner in one go once every service is ready.
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if m := _SERVING.search(line):
            url = m.group(1)
        elif m := _NATS.match(line):
            nats = m.group(1)
        elif m := _PID.match(line.rstrip("\n")):
            pids[m.group(1)] = int(m.group(2))
        elif line.startswith("logs:") and url and nats:
            return RunningUp(url, None, nats, Path(), pids), ""
    return None, "\n".join(seen[-20:])


def _with_secrets(running: RunningUp, state_dir: Path) -> RunningUp:
    """``running`` with the run's key and the admin's NATS credentials, from the state dir."""
    running.state_dir = state_dir
    running.api_key = read_startup_key(state_dir)
    admin = admin_files(state_dir).get("nats")
    if admin is not None:
        running.nats_url = Credentials.read(admin).within(running.nats_url)
    return running


@contextlib.contextmanager
def laneway_up(
    workers: int = 4,
    speedup: float = 1000.0,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    state_dir: Path | None = None,
) -> Iterator[RunningUp]:
    """A `laneway up --workers N --speedup S` on a free port, stopped when the block ends."""
    with contextlib.ExitStack() as stack:
        if state_dir is None:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lw-bench-")))
        command = [
            sys.executable, "-m", "infra.cli", "up",
            "--port", str(free_port()),
            "--workers", str(workers),
            "--speedup", f"{speedup:g}",
            "--state-dir", str(state_dir),
            *extra_args,
        ]  # fmt: skip
        # A session of its own: the whole tree is signalled at the end, as a terminal's Ctrl-C.
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        drain: threading.Thread | None = None
        try:
            running, said = _read_banner(proc)
            if running is None:
                raise RuntimeError(f"laneway up did not start:\n{said}")
            running = _with_secrets(running, state_dir)
            # Its later lines (restarts, the stop) read and dropped: a full pipe would block it.
            drain = threading.Thread(target=deque, args=(proc.stdout, 0), daemon=True)
            drain.start()
            yield running
        finally:
            _stop(proc)
            if drain is not None:
                drain.join(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # Whatever of the group outlived its parent (a child stuck in shutdown).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
