"""`laneway status` on a real local cluster: what it shows as JSON and as one screen of text, a
server that does not answer, and no cluster at all."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from bus.topology import STREAM_SUBJECTS
from infra.cli import main
from infra.cluster import LocalCluster
from infra.ports import free_port
from tests.live import ClusterFactory


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    started = cluster_factory(workers=1, prefill_workers=1, env={"LANEWAY_DISAGG": "always"})
    reply = httpx.post(
        f"{started.config.base_url}/completions",
        json={"model": "laneway-sim", "prompt": "the status of things " * 8, "max_tokens": 4},
        headers=started.api_headers,
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return started


def _status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = _status(capsys, *args, "--json")
    return code, json.loads(out)


def test_json_shows_services_workers_streams_and_health(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    code, found = _json(capsys, "--state-dir", str(cluster.config.state_dir))
    assert code == 0
    assert found["healthy"] is True
    assert found["source"] == str(cluster.config.state_dir.resolve())
    assert [s["ok"] for s in found["nats"]["servers"]] == [True]
    assert found["nats"]["jetstream"]["enabled"] is True
    (member,) = found["etcd"]["members"]
    assert member["ok"] and member["leader"] and member["version"].startswith("3.")

    pids = cluster.pids()
    workers = {w["pid"]: w for w in found["workers"]}
    assert workers.keys() == {pids["decode-worker-0"], pids["prefill-worker-0"]}
    assert {w["role"] for w in workers.values()} == {"decode", "prefill"}
    for worker in workers.values():
        assert worker["draining"] is False and worker["model"] == "laneway-sim"
        assert worker["lease_granted_s"] == 2  # FAST_WORKERS' LANEWAY_LEASE_TTL_S
        assert 0 <= worker["lease_ttl_left_s"] <= 2
        # The load stream keeps the latest report, sent every 0.2 s.
        assert worker["report_age_s"] < 5
        assert 0 <= worker["kv_usage"] <= 1
        assert worker["kv_blocks_used"] <= worker["kv_blocks_total"]

    services = {s["service"]: s for s in found["services"]}
    for name in ("planner", "kv-indexer", "decode-worker", "prefill-worker"):
        assert services[name]["replicas"] == 1, name
        assert services[name]["processes"] == services[name]["ready"] == 1, name
    assert services["ingress"]["replicas"] is None  # it leaves no trace to count
    assert services["ingress"]["processes"] == services["ingress"]["ready"] == 1
    processes = {p["name"]: p for p in found["processes"]}
    assert processes.keys() == pids.keys()
    assert all(p["alive"] for p in processes.values())
    assert processes["ingress"]["readiness"] == "ready"
    assert len(found["planner"]["replicas"]) == 1

    streams = {s["name"]: s for s in found["streams"]}
    assert {s.name for s in STREAM_SUBJECTS} <= streams.keys()
    assert streams["LW_REQUESTS"]["messages"] >= 1  # the request
    assert streams["LW_OUTCOMES"]["messages"] >= 1  # its end, the worker's
    consumers = {c["name"]: c for c in found["consumers"]}
    assert consumers["planner"]["stream"] == "LW_REQUESTS"
    assert consumers["planner"]["pending"] == 0  # the one request was routed
    assert not any(c["orphaned"] for c in found["consumers"])


def test_text_is_one_screen_naming_what_json_has(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # JSON first: a stream made between the two looks (the kv-indexer's first snapshot makes
    # its object store's) is then in the text, not only in the JSON.
    _, found = _json(capsys, "--state-dir", str(cluster.config.state_dir))
    code, out, err = _status(capsys, "--state-dir", str(cluster.config.state_dir))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].endswith(": healthy")
    assert len(lines) <= 50 and max(map(len, lines)) <= 110, out
    for worker in found["workers"]:
        assert worker["worker_id"][:12] in out
    for section in ("HEALTH", "SERVICES", "WORKERS", "STREAMS", "CONSUMERS"):
        assert any(line.startswith(section) for line in lines), section
    for stream in found["streams"]:
        assert stream["name"] in out


def test_a_nats_server_down_is_shown_and_the_rest_read_from_another(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    code, found = _json(
        capsys,
        "--nats-url",
        f"{dead},{cluster.nats_url}",
        "--etcd-endpoints",
        cluster.etcd_endpoints,
    )
    assert code == 1
    assert found["healthy"] is False and found["source"] == "given"
    down, up = found["nats"]["servers"]
    assert (down["url"], down["ok"], up["ok"]) == (dead, False, True)
    assert down["error"]
    assert len(found["workers"]) == 2 and found["streams"]
    code, out, _ = _status(
        capsys,
        "--nats-url",
        f"{dead},{cluster.nats_url}",
        "--etcd-endpoints",
        cluster.etcd_endpoints,
    )
    assert code == 1 and "DEGRADED" in out.splitlines()[0]
    assert any("DOWN" in line and dead in line for line in out.splitlines())


def test_a_stopped_service_is_named_and_the_status_is_degraded(
    cluster_factory: ClusterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    small = cluster_factory(workers=2)
    worker = small.service("decode-worker-1")
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGKILL)
    worker.proc.wait()
    code, out, _ = _status(capsys, "--state-dir", str(small.config.state_dir))
    assert code == 1 and "DEGRADED" in out.splitlines()[0]
    assert f"! decode-worker-1 (pid {worker.proc.pid}) is not running" in out
    _, found = _json(capsys, "--state-dir", str(small.config.state_dir))
    services = {s["service"]: s for s in found["services"]}
    assert (services["decode-worker"]["processes"], services["decode-worker"]["ready"]) == (1, 1)


def test_ha_shape_shows_every_server_member_and_replica(
    cluster_factory: ClusterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    ha = cluster_factory(workers=1, ha=True)
    # Just started on a loaded machine, a service of the HA shape may not be ready yet.
    deadline = time.monotonic() + 20
    while True:
        code, found = _json(capsys, "--state-dir", str(ha.config.state_dir))
        if code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    unwell = [p for p in found["processes"] if not (p["alive"] and p.get("ready", True))]
    assert code == 0, (unwell, found["nats"], found["etcd"])
    servers = found["nats"]["servers"]
    assert len(servers) == 3 and all(s["ok"] and s["cluster"] for s in servers)
    assert len({s["name"] for s in servers}) == 3
    members = found["etcd"]["members"]
    assert len(members) == 3 and len({m["leader"] for m in members}) == 1
    for stream in found["streams"]:
        if stream["name"].startswith("LW_"):
            assert stream["replicas"] == 3 and stream["leader"], stream
            assert 1 <= stream["replicas_current"] <= 3
    _, out, _ = _status(capsys, "--state-dir", str(ha.config.state_dir))
    assert "/3 current" in out


def test_the_services_settings_name_the_cluster_in_a_pod(
    cluster: LocalCluster,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("LANEWAY_NATS_URL", cluster.nats_url)
    monkeypatch.setenv("LANEWAY_ETCD_ENDPOINTS", cluster.etcd_endpoints)
    code, found = _json(capsys, "--state-dir", str(tmp_path))
    assert (code, found["source"]) == (0, "given")
    assert len(found["workers"]) == 2 and found["processes"] == []


def test_nothing_answering_is_shown_down_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    nats_url, etcd = f"nats://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    code, out, err = _status(capsys, "--nats-url", nats_url, "--etcd-endpoints", etcd)
    assert (code, err) == (1, "")
    assert "DEGRADED" in out.splitlines()[0]
    assert [line.split()[:3] for line in out.splitlines() if "DOWN" in line] == [
        ["NATS", nats_url, "DOWN"],
        ["etcd", etcd, "DOWN"],
    ]
    assert "WORKERS: none" in out and "STREAMS: none" in out


def test_no_running_cluster_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LANEWAY_NATS_URL", raising=False)
    monkeypatch.delenv("LANEWAY_ETCD_ENDPOINTS", raising=False)
    code, out, err = _status(capsys, "--state-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1
    assert str(tmp_path) in err and "--nats-url" in err


@pytest.mark.parametrize(
    ("given", "missing"),
    [("--nats-url", "--etcd-endpoints"), ("--etcd-endpoints", "--nats-url")],
)
def test_one_half_given_without_a_cluster_names_the_other(
    given: str,
    missing: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LANEWAY_NATS_URL", raising=False)
    monkeypatch.delenv("LANEWAY_ETCD_ENDPOINTS", raising=False)
    code, out, err = _status(capsys, given, "127.0.0.1:1", "--state-dir", str(tmp_path))
    assert (code, out) == (2, "")
    assert (
        err.strip()
        == f"laneway status: give {missing} as well (no running `laneway up` to read it from)"
    )
