"""One `laneway up` per state directory: a lock its owner holds while it runs, and the PIDs of
what it started, so that a start after a killed owner stops whatever that owner left behind.

The directory is its owner's alone (0700, tightened if it was not), and so is each log in it
(0600): they hold the bus credentials, the run's API key, and logs that quote what clients sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from pathlib import Path
from typing import BinaryIO

from infra.startup import StartupError

LOCK_FILE = "laneway.lock"
PIDS_FILE = "pids.json"
# The embedded servers' data folders in the state dir (``infra.embedded``).
DATA = ("nats", "etcd")
# How long leftovers get to go after SIGTERM before they are killed.
_LEFTOVER_GRACE_S = 5.0


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; with the PID it names one process,
    even after the PID is reused. None for a process gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def open_log(path: Path) -> BinaryIO:
    """``path`` opened for a child's output to be appended to, readable by its owner only (one
    an earlier run left readable to others is made so too)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


class StateDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock: int | None = None

    def acquire(self) -> list[int]:
        """Take the lock, or say in one line who holds it. Then stop what an owner that died
        without cleaning up left running; returns those PIDs."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(self.path, 0o700)
        except PermissionError:
            raise StartupError(
                f"state dir {self.path} belongs to another user and cannot be made private: "
                "pass a --state-dir of your own"
            ) from None
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # The kernel lets go of it when the owner dies, however it dies.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StartupError(
                f"state dir {self.path} is in use by another laneway up (pid {owner}): "
                "stop it or pass another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd
        return self._stop_leftovers()

    def record(self, pids: dict[str, int]) -> None:
        """Write down what runs now, so that a later start can find it if this owner is killed."""
        known = {name: [pid, start_time(pid)] for name, pid in pids.items()}
        tmp = self.path / (PIDS_FILE + ".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(self.path / PIDS_FILE)

    def release(self) -> None:
        if self._lock is None:
            return
        (self.path / PIDS_FILE).unlink(missing_ok=True)
        os.ftruncate(self._lock, 0)
        os.close(self._lock)
        self._lock = None

    def _stop_leftovers(self) -> list[int]:
        pids = self._recorded() | self._servers_on_our_data()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + _LEFTOVER_GRACE_S
        while time.monotonic() < deadline and any(start_time(pid) for pid in pids):
            time.sleep(0.1)
        for pid in pids:
            if start_time(pid) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        (self.path / PIDS_FILE).unlink(missing_ok=True)
        return sorted(pids)

    def _recorded(self) -> set[int]:
        try:
            known = json.loads((self.path / PIDS_FILE).read_text())
        except (OSError, ValueError):
            return set()
        # Only those still the very processes written down: a PID may have been reused since.
        return {pid for pid, started in known.values() if started and start_time(pid) == started}

    def _servers_on_our_data(self) -> set[int]:
        # Embedded servers name their data folder on their command line; this also finds those
        # of a run that recorded nothing (killed while starting, or from before this file).
        ours = {str(root / data) for root in (self.path, self.path.resolve()) for data in DATA}
        found: set[int] = set()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                args = set((proc / "cmdline").read_bytes().decode(errors="replace").split("\0"))
            except OSError:
                continue
            if args & ours and start_time(int(proc.name)) is not None:
                found.add(int(proc.name))
        return found - {os.getpid()}
