"""`laneway up` as `make run` runs it: separate processes, a working API, nothing left after."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from infra.embedded import free_port

pytestmark = pytest.mark.live  # starts `laneway up` and its services


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent reaps it when it exits).
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_serves_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "up",
            "--port",
            str(port),
            "--state-dir",
            str(tmp_path),
            "--perf-model",
            "fixed",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("logs:") or proc.poll() is not None:
            break
    output = "".join(lines)
    assert f"http://127.0.0.1:{port}/v1" in output, output
    pids = {
        name: int(pid)
        for name, pid in re.findall(r"^\s+(\S+(?: \(embedded\))?)\s+pid (\d+)", output, re.M)
    }
    services = {name.rsplit("-", 1)[0] if name[-1].isdigit() else name for name in pids}
    assert {"ingress", "planner", "kv-indexer", "decode-worker"} <= services
    assert sum(name.startswith("decode-worker") for name in pids) == 2
    for name, pid in pids.items():
        assert _alive(pid), name
        if "embedded" not in name:
            assert "services." in Path(f"/proc/{pid}/cmdline").read_text()

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="laneway-sim", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=8
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 8

    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    time.sleep(0.2)
    assert [name for name, pid in pids.items() if _alive(pid)] == []
