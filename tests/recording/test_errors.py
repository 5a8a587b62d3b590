"""A recording that cannot be read is one line and exit status 2 at the command line, never a
traceback: a missing file, not a recording, corrupt JSON, a cut-off last line or compressed
stream, a newer format or a newer event schema, and a NATS that does not answer."""

from __future__ import annotations

import gzip
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from infra.cli import main
from infra.recording import Recorded, RecordingError, read_recording, write_recording
from schemas.events import RequestAccepted, RequestFinished, RequestSpec, SamplingParams, Usage

ROOT = Path(__file__).resolve().parents[2]
START = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def _request(i: int) -> list[Recorded]:
    at = START + timedelta(seconds=i)
    spec = RequestSpec(
        model="laneway-sim",
        prompt_token_ids=tuple(range(40)),
        block_size=16,
        block_hashes=(11, 12),
        sampling=SamplingParams(max_tokens=8),
        reply_to="ingress-0",
        deadline=at + timedelta(minutes=5),
    )
    accepted = RequestAccepted(source="ingress/0", request_id=f"r{i}", occurred_at=at, spec=spec)
    finished = RequestFinished(
        source="worker/w0",
        request_id=f"r{i}",
        occurred_at=at + timedelta(seconds=0.5),
        worker_id="w0",
        finish_reason="length",
        usage=Usage(prompt_tokens=40, completion_tokens=8),
        ttft_ms=10.0,
        e2e_ms=50.0,
    )
    return [
        Recorded("LW_REQUESTS", 2 * i + 1, "lw.req.accepted", at, accepted),
        Recorded("LW_REQUESTS", 2 * i + 2, "lw.req.done.ingress-0", at, finished),
    ]


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "rec.jsonl"
    write_recording(path, [r for i in range(3) for r in _request(i)], redact=False)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _rewrite(path: Path, n: int, change: dict[str, object], key: str | None = None) -> None:
    """Line ``n`` (0: the header) with ``change`` merged into it (into its ``key`` object)."""
    lines = _lines(path)
    row = orjson.loads(lines[n])
    (row[key] if key else row).update(change)
    lines[n] = orjson.dumps(row) + b"\n"
    path.write_bytes(b"".join(lines))


def _fails(path: Path, *match: str) -> str:
    with pytest.raises(RecordingError) as caught:
        read_recording(path)
    text = str(caught.value)
    assert "\n" not in text and all(m in text for m in match), text
    return text


def test_a_good_recording_reads_back(recording: Path) -> None:
    assert [r.event.request_id for r in read_recording(recording)] == [
        "r0",
        "r0",
        "r1",
        "r1",
        "r2",
        "r2",
    ]


def test_a_missing_file(tmp_path: Path) -> None:
    _fails(tmp_path / "nothing.jsonl", "no such file")


def test_not_a_recording(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    _fails(trace, "not a Laneway recording")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) + b"\n")
    _fails(binary, "not a Laneway recording")
    _fails(tmp_path, "a folder")


def test_corrupt_json_names_the_line(recording: Path) -> None:
    lines = _lines(recording)
    lines[3] = lines[3].replace(b":", b"#", 1)
    recording.write_bytes(b"".join(lines))
    _fails(recording, ":4:", "corrupt JSON")


def test_a_truncated_last_line(recording: Path) -> None:
    recording.write_bytes(recording.read_bytes()[:-30])
    _fails(recording, ":7:", "truncated")


def test_a_truncated_compressed_recording(recording: Path) -> None:
    packed = recording.with_suffix(".jsonl.gz")
    packed.write_bytes(gzip.compress(recording.read_bytes())[:-40])
    _fails(packed, "truncated")


def test_an_unknown_format_version(recording: Path) -> None:
    _rewrite(recording, 0, {"laneway_recording": 2})
    _fails(recording, "recording format 2", "reads format 1")


def test_a_newer_event_schema(recording: Path) -> None:
    _rewrite(recording, 2, {"schema_version": 9}, key="event")
    _fails(recording, ":3:", "RequestFinished schema version 9 is newer")
    _rewrite(recording, 0, {"schema_versions": {"RouteDecided": 4}})
    _fails(recording, ":1:", "RouteDecided schema version 4 is newer")


def test_not_an_event(recording: Path) -> None:
    _rewrite(recording, 1, {"type": "Nonsense"}, key="event")
    _fails(recording, ":2:", "not a valid event")
    _rewrite(recording, 1, {"type": "RequestAccepted", "spec": {"model": 3}}, key="event")
    _fails(recording, ":2:", "not a valid event", "spec")
    lines = _lines(recording)
    recording.write_bytes(lines[0] + b'{"stream": "LW_REQUESTS"}\n')
    _fails(recording, ":2:", "not a recorded message")


def test_the_cli_prints_one_line_and_exits_2(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recording.write_bytes(recording.read_bytes()[:-5])
    assert main(["bench", "--trace", str(recording), "--policy", "kv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("laneway: ") and err.count("\n") == 1 and "truncated" in err


@pytest.mark.live  # runs `laneway` three times
def test_the_cli_as_a_process(recording: Path, tmp_path: Path) -> None:
    _rewrite(recording, 0, {"laneway_recording": 7})
    for args, said in (
        (["bench", "--trace", str(recording), "--format", "recording"], "recording format 7"),
        (
            [
                "record",
                "export",
                "--nats-url",
                "nats://admin:s3cret@127.0.0.1:1",
                "-o",
                str(tmp_path / "o"),
            ],
            "cannot reach NATS at nats://127.0.0.1:1 (",
        ),
        (["record", "export", "--since", "yesterday", "-o", str(tmp_path / "o")], "not a time"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "infra.cli", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("laneway: ") and done.stderr.count("\n") == 1, done.stderr
        assert said in done.stderr and "s3cret" not in done.stderr


def test_a_replay_of_a_log_without_decisions_says_so_and_fails(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its requests were accepted and finished, none was routed in it (a window too narrow).
    assert main(["replay", str(recording)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "laneway replay: no routing decision in this log: nothing to replay"


def test_explain_of_a_too_short_id_asks_for_more_of_it(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", "r", str(recording)]) == 2
    assert capsys.readouterr().err.strip() == (
        "laneway explain: give at least 6 characters of the request id"
    )


def test_what_if_flags_without_a_policy_are_refused(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(recording), "--workers", "5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "laneway replay: --workers ask what if: give --policy too"
    )


def test_an_export_window_that_ends_before_it_begins_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["record", "export", "--since", "-1m", "--until", "-2m", "-o", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "comes after --until -2m: an empty window" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
