"""Recordings: a time window of a cluster's log in one portable file, and the log read back.

A recording is JSON Lines (gzip-compressed when its name ends in ``.gz``): a header line, then one
line per stored message with its stream, stream sequence number, subject and stream timestamp.
``laneway record export`` writes one; ``laneway explain``, ``laneway replay`` and ``laneway bench
--trace`` read one. Anything that cannot be read is a :class:`RecordingError` whose text is one
line, for the command line to print as it is.
"""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, cast

import orjson
from pydantic import ValidationError

from bus.credentials import nats_options, split_credentials
from schemas.codec import current_version, decode_event, event_from
from schemas.events import (
    Event,
    PlannerConfigured,
    PrefillCompleted,
    RequestAccepted,
    RouteDecided,
    new_id,
)

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

FORMAT_VERSION = 1
HEADER_KEY = "laneway_recording"
# A fetch asks for at most this many messages, and no more than this many bytes' worth of the
# last batch's largest: nats-server drops a connection that has more than 64 MiB on its way.
_FETCH_BATCH = 2000
_FETCH_BYTES = 16 << 20
_FETCH_TIMEOUT_S = 5.0


class RecordingError(Exception):
    """A recording (or the log) that cannot be read; ``str()`` is one line that says why."""


@dataclass(frozen=True)
class Recorded:
    """One stored message: where the log holds it, when the stream stored it, the event."""

    stream: str
    seq: int
    subject: str
    time: datetime
    event: Event


@dataclass(frozen=True)
class Window:
    """The time window a recording was asked for; None: open on that side."""

    since: datetime | None = None
    until: datetime | None = None


def redacted(event: Event) -> Event:
    """The event without prompt text: token ids dropped, their count, block hashes and
    everything else kept but the cache salt, without which a salted prompt's hashes cannot be
    matched against guessed prompts (a replay reads the hashes, never the salt)."""
    if isinstance(event, RequestAccepted | RouteDecided):
        spec = event.spec.model_copy(
            update={
                "prompt_token_ids": (),
                "prompt_tokens": event.spec.prompt_length,
                "cache_salt": None,
            }
        )
        return event.model_copy(update={"spec": spec})
    if isinstance(event, PrefillCompleted) and event.first_token_id is not None:
        return event.model_copy(update={"first_token_id": None})
    return event


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def write_recording(
    path: Path, recorded: Sequence[Recorded], redact: bool, window: Window = Window()
) -> None:
    """One file of ``recorded`` in their order; ``redact``: without prompt text (:func:`redacted`),
    said so in the header."""
    versions: dict[str, int] = {}
    for r in recorded:
        versions[r.event.type] = max(versions.get(r.event.type, 0), r.event.schema_version)
    header = {
        HEADER_KEY: FORMAT_VERSION,
        "laneway_version": version("laneway"),
        "created": datetime.now(UTC).isoformat(),
        "since": _iso(window.since),
        "until": _iso(window.until),
        "redacted": redact,
        "schema_versions": versions,
    }
    with _open(path, "wb") as out:
        out.write(orjson.dumps(header) + b"\n")
        for r in recorded:
            event = redacted(r.event) if redact else r.event
            line = {
                "stream": r.stream,
                "seq": r.seq,
                "subject": r.subject,
                "time": r.time.isoformat(),
                "event": event.model_dump(mode="json"),
            }
            out.write(orjson.dumps(line) + b"\n")


def _open(path: Path, mode: Literal["rb", "wb"]) -> IO[bytes]:
    if path.suffix == ".gz":
        return cast(IO[bytes], gzip.open(path, mode))
    return path.open(mode)


def read_recording(path: Path, keep: Callable[[bytes], bool] | None = None) -> list[Recorded]:
    """Every message of a recording, in file order, events upcast to the current schemas;
    with ``keep``, only those whose line it accepts (a cheap test on the raw line spares decoding
    the rest: `laneway explain` reads one request of a day's log)."""
    try:
        with _open(path, "rb") as handle:
            return _read(path, handle, keep)
    except FileNotFoundError:
        raise RecordingError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise RecordingError(f"{path}: a folder, not a recording") from None
    except EOFError:
        raise RecordingError(f"{path}: truncated (the compressed stream ends early)") from None
    except (OSError, zlib.error) as err:
        raise RecordingError(f"{path}: cannot be read ({err})") from None


def _read(path: Path, lines: IO[bytes], keep: Callable[[bytes], bool] | None) -> list[Recorded]:
    header = lines.readline()
    if not header:
        raise RecordingError(f"{path}: empty, not a recording")
    _check_header(path, header)
    out = []
    for n, line in enumerate(lines, 2):
        if not line.endswith(b"\n"):
            # Every line a writer finishes ends in a newline: without one the file was cut short.
            raise RecordingError(f"{path}:{n}: truncated (the last line is incomplete)")
        if keep is None or keep(line):
            out.append(_message(path, n, line))
    return out


def _check_header(path: Path, line: bytes) -> None:
    try:
        header = orjson.loads(line)
    except orjson.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or HEADER_KEY not in header:
        raise RecordingError(f"{path}: not a Laneway recording (no header line)")
    if header[HEADER_KEY] != FORMAT_VERSION:
        raise RecordingError(
            f"{path}: recording format {header[HEADER_KEY]!r}; this Laneway reads format "
            f"{FORMAT_VERSION}"
        )
    versions = header.get("schema_versions")
    if not isinstance(versions, dict):
        raise RecordingError(f"{path}:1: the header has no schema_versions")
    for event_type, schema in versions.items():
        _check_version(f"{path}:1", event_type, schema)


def _check_version(where: str, event_type: str, schema: Any) -> None:
    if not isinstance(schema, int) or schema > current_version(event_type):
        raise RecordingError(
            f"{where}: {event_type} schema version {schema!r} is newer than this Laneway reads "
            f"({current_version(event_type)}); read it with the Laneway that wrote it"
        )


def _message(path: Path, n: int, line: bytes) -> Recorded:
    where = f"{path}:{n}"
    try:
        raw = orjson.loads(line)
        event_raw = raw["event"]
        _check_version(where, event_raw["type"], event_raw.get("schema_version", 1))
        return Recorded(
            stream=str(raw["stream"]),
            seq=int(raw["seq"]),
            subject=str(raw["subject"]),
            time=datetime.fromisoformat(raw["time"]),
            event=event_from(event_raw),
        )
    except orjson.JSONDecodeError as err:
        raise RecordingError(f"{where}: corrupt JSON ({err})") from None
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise RecordingError(f"{where}: not a valid event ({field}: {first['msg']})") from None
    except (KeyError, TypeError, ValueError) as err:
        raise RecordingError(
            f"{where}: not a recorded message ({type(err).__name__}: {err})"
        ) from None


async def read_log(
    nats_url: str,
    since: datetime | None = None,
    until: datetime | None = None,
    outcomes_only: bool = False,
) -> list[Recorded]:
    """Every message the streams hold from ``since`` to ``until``, each stream up to where it
    ended when the read began (a busy cluster cannot keep the read going), and the planners'
    ``PlannerConfigured`` from before ``since``; ``outcomes_only``: the requests' terminal events
    and tokens alone (the outcomes stream)."""
    # NATS (and the aiohttp it brings) only here: an offline replay reads recordings from files.
    import nats
    from nats.errors import Error as NatsError

    from bus.topology import CONTROL, KV, LOAD, OUTCOMES, REQUESTS, ROUTES, STREAM_SUBJECTS

    causes: list[str] = []

    async def failed(err: Exception) -> None:
        causes.append(getattr(err, "strerror", None) or str(err))

    try:
        nc = await nats.connect(
            name="laneway-record",
            allow_reconnect=False,
            max_reconnect_attempts=1,
            connect_timeout=2,
            error_cb=failed,
            **nats_options(nats_url),
        )
    except (OSError, NatsError) as err:
        cause = causes[-1] if causes else str(err)
        shown = split_credentials(nats_url)[1]  # never a password on the screen
        raise RecordingError(f"cannot reach NATS at {shown} ({cause})") from None
    try:
        out: list[Recorded] = []
        # In the order a reader folds them: the requests, then what was decided and what followed.
        streams = (OUTCOMES,) if outcomes_only else (REQUESTS, ROUTES, OUTCOMES, KV, LOAD, CONTROL)
        for stream in streams:
            # A planner records its settings once, when it starts: a window that begins later
            # takes them from before it, or its decisions could not be made again.
            start = None if stream is CONTROL else since
            try:
                read = await _read_stream(nc, stream.name, STREAM_SUBJECTS[stream], start, until)
            except NatsError as err:
                raise RecordingError(f"reading {stream.name} failed ({err})") from None
            if stream is CONTROL and since is not None:
                read = [
                    r for r in read if r.time >= since or isinstance(r.event, PlannerConfigured)
                ]
            out += read
        return out
    finally:
        await nc.close()


async def _read_stream(
    nc: NatsClient,
    name: str,
    subjects: Sequence[str],
    since: datetime | None,
    until: datetime | None,
) -> list[Recorded]:
    from nats.errors import TimeoutError as NatsTimeoutError
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        return []  # a cluster that never wrote this stream
    if info.state.messages == 0:
        return []
    last = info.state.last_seq
    # An ephemeral consumer of our own, read without acks and deleted when done.
    consumer = f"laneway-record-{new_id()}"
    await js.add_consumer(
        name,
        ConsumerConfig(
            name=consumer,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
            opt_start_time=since,
            filter_subjects=list(subjects),
            inactive_threshold=60.0,
        ),
    )
    sub = await js.pull_subscribe_bind(consumer, stream=name)
    out: list[Recorded] = []
    try:
        pending = (await sub.consumer_info()).num_pending
        batch = 1
        while pending:
            try:
                msgs = await sub.fetch(min(batch, pending), timeout=_FETCH_TIMEOUT_S)
            except NatsTimeoutError:
                return out  # what was pending aged out of the stream meanwhile
            largest = max(len(m.data) for m in msgs)
            batch = max(1, min(_FETCH_BATCH, _FETCH_BYTES // max(1, largest)))
            for msg in msgs:
                meta = msg.metadata
                seq = meta.sequence.stream
                if seq > last or (until is not None and meta.timestamp > until):
                    return out
                event = _decoded(msg.data, name, seq)
                out.append(Recorded(name, seq, msg.subject, meta.timestamp, event))
                pending = meta.num_pending
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(name, consumer)
    return out


def _decoded(data: bytes, stream: str, seq: int) -> Event:
    try:
        event = decode_event(data)
    except (ValidationError, ValueError) as err:
        first = str(err).splitlines()[0]
        raise RecordingError(f"{stream} #{seq}: not a Laneway event ({first})") from None
    _check_version(f"{stream} #{seq}", event.type, event.schema_version)
    return event
