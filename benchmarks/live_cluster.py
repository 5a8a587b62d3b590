"""`laneway up` as a benchmark's child: started on free ports in a state dir of its own, known
ready, with its services' pids, the admin's NATS URL and the run's API key, the way `laneway
status` knows them from the state dir (infra/up_processes.py), stopped as Ctrl-C would."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infra import up_processes
from infra.keys import read_startup_key
from infra.ports import free_port

# How long `laneway up` may take to have every service ready (it bounds its own start-up too).
_READY_WITHIN_S = 180.0
_EMBEDDED = " (embedded)"
# The embedded servers' names among ``RunningUp.pids``; the rest are Laneway's services.
SERVERS = ("nats", "etcd")


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


def _when_ready(
    proc: subprocess.Popen[str], port: int, state_dir: Path, said: deque[str]
) -> RunningUp:
    """Once every process the `laneway up` on ``state_dir`` started runs and each service
    answers ready on its ``/readyz``, as `laneway status` reads them (its processes and their
    settings, the admin's credentials, the run's key): nothing parsed from what it prints."""
    deadline = time.monotonic() + _READY_WITHIN_S
    while time.monotonic() < deadline and proc.poll() is None:
        local = up_processes.processes(state_dir)
        found = up_processes.urls(local)
        probed = asyncio.run(up_processes.probe(local)) if local else []
        ready = probed and all(p["alive"] and p.get("ready", True) for p in probed)
        if ready and found is not None:
            pids = {p["name"].removesuffix(_EMBEDDED): p["pid"] for p in local}
            base_url = f"http://127.0.0.1:{port}/v1"
            return RunningUp(base_url, read_startup_key(state_dir), found[0], state_dir, pids)
        time.sleep(0.5)
    raise RuntimeError("laneway up did not start:\n" + "\n".join(said))


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
        port = free_port()
        command = [
            sys.executable, "-m", "infra.cli", "up",
            "--port", str(port),
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
        # What it prints read all along (a full pipe would block it), its last lines kept to
        # say why, should it not start.
        said: deque[str] = deque(maxlen=20)
        drain = threading.Thread(target=said.extend, args=(proc.stdout,), daemon=True)
        drain.start()
        try:
            yield _when_ready(proc, port, state_dir, said)
        finally:
            _stop(proc)
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


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster and the closed loop of :func:`closed_loop`, as a benchmark's flags."""
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=1000.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)


def closed_loop(
    up: RunningUp, concurrency: int, seconds: float, max_tokens: int, label: str
) -> subprocess.Popen[bytes]:
    """The load client in a process of its own (its CPU apart from the cluster's): a closed loop
    of ``concurrency`` streams against ``up`` for ``seconds``; its JSON report on stdout."""
    return subprocess.Popen(
        [
            sys.executable, "-m", "infra.bench.load_client", "--base-url", up.base_url,
            "--concurrency", str(concurrency), "--duration", f"{seconds:g}",
            "--max-tokens", str(max_tokens), "--warmup", "0", "--label", label,
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "LANEWAY_API_KEY": up.api_key or ""},
    )  # fmt: skip
