"""`laneway record export` against a real cluster (all services, NATS, etcd): the recording holds
every stream's messages with their positions and times, reads back to the same events, and a
redacted one keeps counts and block hashes but no prompt token."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import orjson
import pytest

from infra.bench.traces import PromptFactory, load_trace
from infra.cli import main
from infra.cluster import LocalCluster
from infra.recording import Recorded, read_log, read_recording
from schemas.events import PlannerConfigured, RequestAccepted, RequestFinished, RouteDecided
from services.planner.decision import inputs_of
from tests.helpers import eventually
from tests.live import ClusterFactory

MODEL = "laneway-sim"
REQUESTS = 6


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    cluster = cluster_factory(workers=2)
    client = openai.OpenAI(base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0)
    # Three conversations of two turns: each turn's prompt extends its conversation's last.
    for i in range(REQUESTS):
        history = f"conversation {i % 3} about a long shared subject. " * 8 + "turn 1" * (i // 3)
        client.completions.create(model=MODEL, prompt=history, max_tokens=4 + i)
    return cluster


def _finished(cluster: LocalCluster) -> list[Recorded]:
    async def read() -> list[Recorded]:
        log: list[Recorded] = []

        async def done() -> bool:
            log[:] = await read_log(cluster.nats_url)
            return sum(isinstance(r.event, RequestFinished) for r in log) == REQUESTS

        await eventually(done)
        return log

    return asyncio.run(read())


def test_export_holds_every_stream_and_reads_back(cluster: LocalCluster, tmp_path: Path) -> None:
    log = _finished(cluster)
    out = tmp_path / "rec.jsonl"
    assert main(["record", "export", "--nats-url", cluster.nats_url, "-o", str(out)]) == 0
    recorded = read_recording(out)
    kinds = Counter(r.event.type for r in recorded)
    assert kinds["RequestAccepted"] == kinds["RouteDecided"] == kinds["RequestFinished"] == REQUESTS
    assert kinds["KvChanged"] >= 1 and kinds["WorkerLoadReported"] >= 1
    assert kinds["PlannerConfigured"] == 1
    assert {r.stream for r in recorded} == {
        "LW_REQUESTS",
        "LW_ROUTES",
        "LW_OUTCOMES",
        "LW_KV",
        "LW_LOAD",
        "LW_CONTROL",
    }
    # What the file holds is what the log held, message for message (load reports excepted:
    # their stream keeps only each worker's latest).
    by_position = {(r.stream, r.seq): r.event for r in recorded}
    for r in log:
        if r.stream != "LW_LOAD":
            assert by_position[(r.stream, r.seq)] == r.event
    for stream in {r.stream for r in recorded}:
        seqs = [r.seq for r in recorded if r.stream == stream]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(r.time.tzinfo is not None for r in recorded)
    header = orjson.loads(out.read_bytes().split(b"\n", 1)[0])
    assert header["laneway_recording"] == 1 and header["redacted"] is False
    assert header["schema_versions"]["RouteDecided"] == 3


def test_redacted_export_has_counts_and_hashes_but_no_tokens(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    full = [r for r in _finished(cluster) if isinstance(r.event, RequestAccepted | RouteDecided)]
    out = tmp_path / "rec.jsonl.gz"
    args = ["record", "export", "--nats-url", cluster.nats_url, "--redact", "-o", str(out)]
    assert main(args) == 0
    redacted = {(r.stream, r.seq): r.event for r in read_recording(out)}
    assert len(full) == 2 * REQUESTS
    for original in full:
        event = redacted[(original.stream, original.seq)]
        assert isinstance(event, RequestAccepted | RouteDecided)
        spec, before = event.spec, original.event.spec  # type: ignore[union-attr]
        assert spec.prompt_token_ids == () and spec.prompt_tokens == len(before.prompt_token_ids)
        assert spec.prompt_length == before.prompt_length
        assert spec.block_hashes == before.block_hashes
        if isinstance(event, RouteDecided):
            assert isinstance(original.event, RouteDecided)
            assert inputs_of(event) == inputs_of(original.event)


def test_a_window_holds_only_its_messages(cluster: LocalCluster, tmp_path: Path) -> None:
    log = _finished(cluster)
    future = datetime.now(UTC) + timedelta(hours=1)
    out = tmp_path / "later.jsonl"
    args = ["record", "export", "--nats-url", cluster.nats_url, "-o", str(out)]
    assert main([*args, "--since", future.isoformat()]) == 0
    # But for the planners' settings, from before it: its decisions need them to be replayed.
    later = read_recording(out)
    assert later and all(isinstance(r.event, PlannerConfigured) for r in later)
    assert main([*args, "--until", "-1h"]) == 0
    assert read_recording(out) == []
    assert main([*args, "--since", "-1h"]) == 0
    # LW_LOAD keeps each worker's newest report only: a read while one replaces another can see
    # both, a later one only the newer, so its count may shrink between two reads.
    assert len(_unreplaced(read_recording(out))) >= len(_unreplaced(log))


def _unreplaced(records: list[Recorded]) -> list[Recorded]:
    return [r for r in records if r.stream != "LW_LOAD"]


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_a_recording_is_a_trace_sharing_what_the_requests_shared(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    log = _finished(cluster)
    out = tmp_path / "rec.jsonl"
    assert (
        main(["record", "export", "--nats-url", cluster.nats_url, "--redact", "-o", str(out)]) == 0
    )
    accepted = sorted(
        (r.event for r in log if isinstance(r.event, RequestAccepted)), key=lambda e: e.occurred_at
    )
    finished = {r.event.request_id: r.event for r in log if isinstance(r.event, RequestFinished)}
    trace = load_trace(out)
    assert len(trace) == REQUESTS and trace[0].arrival_s == 0.0
    block_size = accepted[0].spec.block_size
    for request, event in zip(trace, accepted, strict=True):
        since_first = (event.occurred_at - accepted[0].occurred_at).total_seconds()
        assert request.arrival_s == pytest.approx(since_first, abs=1e-6)
        assert request.input_length == event.spec.prompt_length
        assert request.output_length == finished[event.request_id].usage.completion_tokens
    # At the recording's block size and at a coarser one, two prompts share as many leading
    # blocks as the live ones did.
    for size in (block_size, 4 * block_size):
        prompts = PromptFactory(size)
        made = [prompts.block_hashes(r) for r in trace]
        for a in range(REQUESTS):
            assert len(made[a]) == accepted[a].spec.prompt_length // size
            for b in range(REQUESTS):
                live = _shared(accepted[a].spec.block_hashes, accepted[b].spec.block_hashes)
                assert _shared(made[a], made[b]) == live * block_size // size, (a, b, size)
    assert any(_shared(made[0], m) > 0 for m in made[1:]), "the conversations share blocks"


def test_a_recording_replays_offline_through_laneway_bench(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    _finished(cluster)
    recording = tmp_path / "rec.jsonl.gz"
    assert main(["record", "export", "--nats-url", cluster.nats_url, "-o", str(recording)]) == 0
    report = tmp_path / "bench.json"
    # Arrivals ten times further apart than recorded: a fast live run sends each turn while its
    # conversation's worker still serves the one before, and the kv policy then rightly
    # recomputes a short prompt elsewhere; spread out, every second turn finds its history.
    args = ["bench", "--trace", str(recording), "--workers", "2", "--json", str(report)]
    args += ["--speedup", "0.1"]
    assert main([*args, "--policy", "kv", "--policy", "round_robin"]) == 0
    reports = orjson.loads(report.read_bytes())
    for policy in ("kv", "round_robin"):
        assert reports[policy]["requests"] == reports[policy]["completed"] == REQUESTS
    assert reports["kv"]["prefix_hit_rate"] > 0.0
