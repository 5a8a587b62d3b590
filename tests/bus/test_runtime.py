"""A service stops on SIGTERM even while it is still starting up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from infra.ports import free_port

pytestmark = pytest.mark.live  # starts a service process


def test_a_service_waiting_for_nats_still_stops_on_sigterm() -> None:
    env = {**os.environ, "LANEWAY_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.planner"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(3)  # well inside its connection retries
    assert proc.poll() is None
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # two signals sent at once would merge into one
    proc.send_signal(signal.SIGTERM)  # a second signal: stop now, as Ctrl-C twice would
    assert proc.wait(15) is not None
    assert time.monotonic() - started < 5
