"""`laneway up` as a child of the test: start it, read what it prints, tell which PIDs live."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from infra.keys import read_startup_key


def launch(
    port: int,
    state_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    api_auth: bool = True,
) -> subprocess.Popen[str]:
    """``env``: settings for every service, on top of this process's environment; ``api_auth``:
    the API takes keys, as `laneway up` does by default (``api_headers`` once it serves)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "up",
            "--port",
            str(port),
            "--state-dir",
            str(state_dir),
            "--perf-model",
            "fixed",
            *([] if api_auth else ["--no-auth"]),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_serving(proc: subprocess.Popen[str], timeout: float = 30) -> dict[str, int]:
    """Read its output until it says where its logs are (it serves then); the PIDs it listed."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("logs:") or (not line and proc.poll() is not None):
            break
    output = "".join(lines)
    assert "serving the OpenAI API" in output, output + (proc.stderr.read() if proc.stderr else "")
    return {
        name: int(pid)
        for name, pid in re.findall(r"^\s+(\S+(?: \(embedded\))?)\s+pid (\d+)", output, re.M)
    }


def api_key(state_dir: Path) -> str:
    """The key of the `laneway up` serving on ``state_dir``, as it wrote it there."""
    key = read_startup_key(state_dir)
    assert key is not None, f"no API key in {state_dir}: a laneway up with --no-auth?"
    return key


def api_headers(state_dir: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key(state_dir)}"}


def alive(pid: int) -> bool:
    # A zombie is dead for our purposes: it runs nothing and holds no port.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def survivors(pids: dict[str, int], within: float) -> dict[str, int]:
    """Those of ``pids`` still alive once ``within`` seconds have passed (or none are left)."""
    deadline = time.monotonic() + within
    while True:
        left = {name: pid for name, pid in pids.items() if alive(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def processes_naming(path: Path) -> list[int]:
    """Live processes with ``path`` (or a path under it) on their command line."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline and alive(int(proc.name)) and int(proc.name) != os.getpid():
            found.append(int(proc.name))
    return found
