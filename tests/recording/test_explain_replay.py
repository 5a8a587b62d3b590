"""`laneway explain` and `laneway replay` against a real cluster's log (all services, NATS, etcd,
conversations with sessions, local and remote prefills), read both straight from JetStream and
from a recording: explain shows a request's timeline and every candidate's cost terms, replay
makes every decision again identically, and the what-if puts a simulated policy beside the
recorded figures. What cannot be answered is one line and exit status 2."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from infra.cli import main
from infra.cluster import LocalCluster
from infra.recording import Recorded, read_log, write_recording
from schemas.events import PlannerConfigured, RequestCancelled, RequestFinished
from tests.helpers import eventually
from tests.live import ClusterFactory

MODEL = "laneway-sim"
USERS, TURNS = 4, 3
# The conversations' decisions, and the cancelled request's.
DECISIONS = USERS * TURNS + 1
ENV = {"LANEWAY_DISAGG": "auto", "LANEWAY_DISAGG_MIN_REMOTE_TOKENS": "0"}


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    cluster = cluster_factory(workers=2, prefill_workers=1, env=ENV)

    async def conversation(client: openai.AsyncOpenAI, user: int) -> None:
        history = f"user {user} asks for a long summary of the city's traffic report. " * 10
        for turn in range(TURNS):
            history += f" turn {turn}:"
            answer = await client.completions.create(
                model=MODEL, prompt=history, max_tokens=6, user=f"user-{user}"
            )
            history += answer.choices[0].text

    async def drive() -> None:
        client = openai.AsyncOpenAI(
            base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
        )
        await asyncio.gather(*(conversation(client, u) for u in range(USERS)))
        # And one the client walks away from after its first token: the worker cancels it.
        stream = await client.completions.create(
            model=MODEL, prompt="a long answer, please", max_tokens=4000, stream=True
        )
        async for _ in stream:
            break
        await stream.close()

    asyncio.run(drive())
    return cluster


@pytest.fixture(scope="module")
def log(cluster: LocalCluster) -> list[Recorded]:
    async def read() -> list[Recorded]:
        got: list[Recorded] = []

        async def done() -> bool:
            got[:] = await read_log(cluster.nats_url)
            ended = Counter(r.event.type for r in got)
            # The streams are read one after another: a read may take the worker's
            # RequestCancelled and miss the ingress's CancellationRequested before it.
            return (
                ended["RequestFinished"] == USERS * TURNS
                and ended["RequestCancelled"] == ended["CancellationRequested"] == 1
            )

        await eventually(done)
        return got

    return asyncio.run(read())


@pytest.fixture(scope="module")
def recording(log: list[Recorded], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rec") / "run.jsonl.gz"
    write_recording(path, log, redact=True)
    return path


@pytest.fixture(params=["nats", "file"])
def source(request: pytest.FixtureRequest, cluster: LocalCluster, recording: Path) -> list[str]:
    return ["--nats-url", cluster.nats_url] if request.param == "nats" else [str(recording)]


def _finished_ids(log: list[Recorded]) -> list[str]:
    return [r.event.request_id or "" for r in log if isinstance(r.event, RequestFinished)]


def test_explain_shows_the_timeline_and_every_candidates_terms(
    log: list[Recorded], source: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for request_id in _finished_ids(log):
        assert main(["explain", request_id, *source, "--json"]) == 0
        explained = json.loads(capsys.readouterr().out)
        assert explained["request_id"] == request_id
        events = [step["event"] for step in explained["timeline"]]
        assert events[:2] == ["accepted", "routed"] and events[-1] == "finished"
        assert "first_token" in events and all(step["time"] for step in explained["timeline"])
        assert len(explained["candidates"]) == 2
        for candidate in explained["candidates"]:
            assert {"worker_id", "cached_blocks", "running", "in_flight", "cost"} <= set(candidate)
        chosen = [c for c in explained["candidates"] if c["chosen"]]
        assert [c["worker_id"] for c in chosen] == [explained["worker_id"]]
        assert len(explained["trace_id"]) == 32 and explained["policy"] == "kv"
        # No adapter asked: none is weighed.
        assert (explained["model"], explained["lora"]) == (MODEL, None)
        assert all(c["lora_resident"] is None for c in explained["candidates"])
        prefill = explained["prefill"]
        assert prefill is not None and len(prefill["candidates"]) == 1
        if prefill["prefill_worker_id"] is not None:
            assert "prefill_completed" in events
    # A later turn goes back to its session's owner, and says so.
    assert explained["session_owner"] == explained["worker_id"]
    assert main(["explain", request_id, *source]) == 0
    text = capsys.readouterr().out
    assert f"request {request_id}" in text and "decode candidates" in text and "cost" in text
    assert f"  model     {MODEL}\n" in text and "adapter" in text


def test_each_requests_events_name_one_trace(log: list[Recorded]) -> None:
    """The cluster records no spans (no exporter): each hop carries the trace it was given."""
    traces: dict[str, set[str]] = {}
    for recorded in log:
        event = recorded.event
        if event.request_id and event.trace is not None:
            traces.setdefault(event.request_id, set()).add(event.trace.traceparent.split("-")[1])
    finished = _finished_ids(log)
    assert finished and all(len(traces[request_id]) == 1 for request_id in finished)
    assert len({next(iter(traces[request_id])) for request_id in finished}) == len(finished)
    for request_id in finished:
        kinds = {r.event.type for r in log if r.event.request_id == request_id and r.event.trace}
        assert {"RequestAccepted", "RouteDecided", "RequestFinished"} <= kinds


def test_replay_makes_every_decision_again_identically(
    log: list[Recorded], source: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "replay.json"
    assert main(["replay", *source, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["decisions"] == report["identical"] == DECISIONS
    assert report["differing"] == []
    assert f"{DECISIONS} identical" in capsys.readouterr().out


def test_replay_names_the_terms_a_change_moved(
    log: list[Recorded], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The planner's settings changed as a code change would change them: every cost moves.
    changed = []
    for r in log:
        if isinstance(r.event, PlannerConfigured):
            kv = {**r.event.kv, "stall_weight": r.event.kv["stall_weight"] * 10 + 1}
            r = replace(r, event=r.event.model_copy(update={"kv": kv}))
        changed.append(r)
    path, out = tmp_path / "changed.jsonl", tmp_path / "replay.json"
    write_recording(path, changed, redact=False)
    assert main(["replay", str(path), "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["decisions"] == DECISIONS and report["differing"]
    assert report["identical"] + len(report["differing"]) == DECISIONS
    for diff in report["differing"]:
        assert diff["request_id"] in {r.event.request_id for r in log}
        assert any(term.endswith(".cost") for term in diff["moved"]), diff
        assert all(": " in change and " -> " in change for change in diff["changes"])
    assert f"{len(report['differing'])} differ" in capsys.readouterr().out


def test_explain_tells_a_cancelled_request(
    log: list[Recorded], recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cancelled = next(r.event for r in log if isinstance(r.event, RequestCancelled))
    # As the API names it, and by a unique prefix of its id.
    for given in (f"cmpl-{cancelled.request_id}", (cancelled.request_id or "")[:12]):
        assert main(["explain", given, str(recording), "--json"]) == 0
        explained = json.loads(capsys.readouterr().out)
        assert explained["request_id"] == cancelled.request_id
        events = [step["event"] for step in explained["timeline"]]
        assert events[:2] == ["accepted", "routed"]
        assert events[-2:] == ["cancel_requested", "cancelled"]
        assert explained["timeline"][-1]["reason"] == cancelled.reason


def test_what_if_puts_another_policy_beside_the_recorded_run(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "what-if.json", tmp_path / "what-if.png"
    argv = ["replay", str(recording), "--policy", "round_robin", "--json", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    for side in ("recorded", "what_if"):
        figures = report[side]
        assert figures["requests"] == DECISIONS and figures["completed"] >= USERS * TURNS
        assert {"prefix_hit_rate", "ttft_ms", "itl_ms", "e2e_ms"} <= set(figures)
        assert figures["ttft_ms"]["p50"] > 0 and figures["e2e_ms"]["p95"] > 0
    assert report["recorded"]["prefix_hit_rate"] > 0
    assert report["recorded"]["itl_ms"]["p95"] > 0
    # Only the kv policy places prefills: round robin gets the decode pool alone.
    assert report["settings"]["workers"] == 2 and report["settings"]["prefill_workers"] == 0
    # The recorded run's workers ran at their perf model's own pace: nothing to scale back.
    assert report["settings"]["time_scale"] == 1.0
    assert png.stat().st_size > 0
    assert "what-if round_robin" in capsys.readouterr().out


def _laneway(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *argv], capture_output=True, text=True, timeout=60
    )


def test_what_cannot_be_answered_is_one_line_and_exit_2(
    log: list[Recorded], recording: Path, tmp_path: Path
) -> None:
    unknown = _laneway("explain", "no-such-request", str(recording))
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr == "laneway explain: no request no-such-request in this log\n"
    # A recording without its planner's settings cannot be replayed, and says whose are missing.
    headless = tmp_path / "no-config.jsonl"
    write_recording(headless, [r for r in log if r.event.type != "PlannerConfigured"], False)
    missing = _laneway("replay", str(headless))
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1
    assert missing.stderr.startswith("laneway replay: no PlannerConfigured for planner/")
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(headless.read_bytes()[:-40])
    for argv in (
        ("explain", "x", str(cut)),
        ("replay", str(cut)),
        ("replay", "--nats-url", "nats://127.0.0.1:1"),
    ):
        broken = _laneway(*argv)
        assert broken.returncode == 2 and len(broken.stderr.splitlines()) == 1, broken.stderr
        assert "Traceback" not in broken.stderr
