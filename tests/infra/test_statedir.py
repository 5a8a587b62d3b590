"""The state dir's lock: one owner at a time, and what a dead owner left running is stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.embedded import find_binary, wait_for_port
from infra.ports import free_port
from infra.startup import StartupError
from infra.statedir import StateDir
from tests.infra.laneway_up import alive

pytestmark = pytest.mark.live  # starts processes that outlive their owner


def test_a_held_state_dir_is_refused_naming_its_owner(tmp_path: Path) -> None:
    owner = StateDir(tmp_path)
    assert owner.acquire() == []
    try:
        with pytest.raises(StartupError, match=r"in use by another laneway up \(pid \d+\)"):
            StateDir(tmp_path).acquire()
    finally:
        owner.release()
    StateDir(tmp_path).acquire()


OWNER = """
import subprocess, sys, time
from pathlib import Path
from infra.statedir import StateDir
state = StateDir(Path(sys.argv[1]))
state.acquire()
child = subprocess.Popen(["sleep", "60"], start_new_session=True)
state.record({"sleeper": child.pid})
print(child.pid, flush=True)
time.sleep(60)
"""


def test_what_a_killed_owner_recorded_is_stopped_by_the_next(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    sleeper = int(owner.stdout.readline())
    owner.kill()
    owner.wait()
    assert alive(sleeper)  # no parent-death signal: it outlived its owner
    assert StateDir(tmp_path).acquire() == [sleeper]
    assert not alive(sleeper)


def test_a_server_on_the_state_dirs_data_is_stopped_though_nothing_recorded_it(
    tmp_path: Path,
) -> None:
    store = tmp_path / "nats"
    store.mkdir()
    port = str(free_port())
    stale = subprocess.Popen(
        [find_binary("nats-server"), "-a", "127.0.0.1", "-p", port, "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(int(port), stale, "nats-server", 10)  # a server running, not one starting
        assert StateDir(tmp_path).acquire() == [stale.pid]
        assert stale.wait(5) is not None
    finally:
        stale.kill()
