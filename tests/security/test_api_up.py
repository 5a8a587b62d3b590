"""`laneway up` takes API keys by default, and `laneway keys` finds its etcd through the state
dir: a key made there is taken, a request without one refused; the run's own key is kept in the
state dir (0600) while it runs, for tools and benchmarks of the same user."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from infra.keys import STARTUP_KEY_FILE
from infra.ports import free_port
from tests.infra.laneway_up import api_headers, launch, wait_serving

pytestmark = pytest.mark.live  # starts `laneway up`, its servers and services

REPO = Path(__file__).resolve().parents[2]


def test_up_takes_keys_made_through_its_state_dir(tmp_path: Path) -> None:
    port = free_port()
    up = launch(port, tmp_path, "--workers", "1")
    try:
        wait_serving(up)
        base = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(base + "/models", timeout=5).status_code == 401
        assert (tmp_path / STARTUP_KEY_FILE).stat().st_mode & 0o777 == 0o600
        own = httpx.get(base + "/models", headers=api_headers(tmp_path), timeout=5)
        assert own.status_code == 200, own.text
        made = subprocess.run(
            [sys.executable, "-m", "infra.cli", "keys", "create", "--tenant", "team-a"],
            cwd=tmp_path.parent,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"PYTHONPATH": str(REPO)},
        )
        assert made.returncode == 2 and "no laneway up runs on .state" in made.stderr
        made = subprocess.run(
            [
                *(sys.executable, "-m", "infra.cli", "keys", "create"),
                *("--tenant", "team-a", "--state-dir", str(tmp_path)),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert made.returncode == 0, made.stderr
        key = made.stdout.splitlines()[-1]
        reply = httpx.post(
            base + "/completions",
            json={"model": "laneway-sim", "prompt": "Once", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(20) == 0
    assert not (tmp_path / STARTUP_KEY_FILE).exists()
