"""`laneway up` as `make run` runs it: separate processes, a working API, nothing left after."""

from __future__ import annotations

import signal
from pathlib import Path

import openai
import pytest

from infra.ports import free_port
from tests.infra.laneway_up import alive, api_key, launch, survivors, wait_serving

pytestmark = pytest.mark.live  # starts `laneway up` and its services


def test_up_serves_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    proc = launch(port, tmp_path)
    pids = wait_serving(proc, timeout=60)
    services = {name.rsplit("-", 1)[0] if name[-1].isdigit() else name for name in pids}
    assert {"ingress", "planner", "kv-indexer", "decode-worker"} <= services
    assert sum(name.startswith("decode-worker") for name in pids) == 2
    for name, pid in pids.items():
        assert alive(pid), name
        if "embedded" not in name:
            assert "services." in Path(f"/proc/{pid}/cmdline").read_text()

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key(tmp_path), max_retries=0
    )
    stream = client.chat.completions.create(
        model="laneway-sim", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=8
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 8

    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert survivors(pids, within=2) == {}
