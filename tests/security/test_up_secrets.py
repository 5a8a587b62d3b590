"""What `laneway up` leaves for others to read: its output names the files of the run's API key
and of the admin's NATS and etcd credentials, never what they hold (a captured stdout, in a CI
log or journald, granted full admin), and its state dir is its owner's alone (0700, its logs
0600), tightened where an earlier run left it open."""

from __future__ import annotations

import json
import signal
import stat
from pathlib import Path

import pytest

from infra.keys import STARTUP_KEY_FILE
from infra.ports import free_port
from tests.infra.laneway_up import api_key, launch

pytestmark = pytest.mark.live  # starts `laneway up`, its servers and services


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_up_prints_where_its_secrets_are_and_keeps_them_to_its_owner(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    earlier_log = state / "logs" / "ingress.log"
    earlier_log.write_text("an earlier run's line\n")
    for path, mode in ((state, 0o755), (state / "logs", 0o755), (earlier_log, 0o644)):
        path.chmod(mode)
    up = launch(free_port(), state, "--workers", "1")
    assert up.stdout is not None
    printed: list[str] = []
    try:
        for line in up.stdout:  # its banner, printed once it serves, ends with its logs' folder
            printed.append(line)
            if line.startswith("logs:"):
                break
        assert "serving the OpenAI API" in "".join(printed)
        secrets = {api_key(state)} | {
            json.loads(path.read_text())["password"] for path in (state / "auth").rglob("*.json")
        }
        assert len(secrets) >= 4  # the key, etcd's root and the admin's NATS and etcd passwords
        logs = {log.name: oct(_mode(log)) for log in (state / "logs").iterdir()}
        assert {"nats.log", "etcd.log", "ingress.log"} <= set(logs)
        state_mode = oct(_mode(state))
    finally:
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=30)
    output = "".join(printed) + out + err
    # All three at once, so that a failure shows each.
    assert (state_mode, logs, [s[:4] + "…" for s in secrets if s in output]) == (
        oct(0o700),
        {name: oct(0o600) for name in logs},
        [],
    )
    assert f"API key of this run in {state / STARTUP_KEY_FILE}" in output
    for server in ("nats", "etcd"):
        assert f"(admin: {state / 'auth' / server / 'admin.json'})" in output
