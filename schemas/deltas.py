"""A token batch's runs as the ``TokensGenerated`` events each request's stream takes, and the
batch read off the wire without a pydantic object per run."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import msgspec

from schemas.codec import current_version
from schemas.events import TokenBatch, TokensGenerated
from schemas.lean import decoder
from schemas.logprobs import TokenLogprob, TopLogprob
from schemas.trusted import trusted


class Run(Protocol):
    """What a run of a batch is read for: a ``TokenRun``, or its struct (:func:`lean_batch`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def text(self) -> str: ...
    @property
    def logprobs(self) -> Sequence[Any]: ...


class Batch(Protocol):
    """What a batch is read for: a ``TokenBatch``, or its struct (:func:`lean_batch`)."""

    @property
    def event_id(self) -> str: ...
    @property
    def occurred_at(self) -> datetime: ...
    @property
    def source(self) -> str: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def runs(self) -> Sequence[Run]: ...


_BATCH = decoder(TokenBatch)
_BATCH_VERSION = current_version("TokenBatch")


def lean_batch(data: bytes) -> Batch | None:
    """The current version's ``TokenBatch`` in ``data``, checked as strictly as the model and
    more (:mod:`schemas.lean`), as a struct: a fifth of pydantic's time for a step's hundreds of
    runs. None for anything else (another event, an older version, a payload only the model may
    judge): :func:`schemas.codec.decode_event` decides those."""
    try:
        batch = _BATCH.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if batch.schema_version != _BATCH_VERSION:
        return None
    lean: Batch = batch
    return lean


def runs_delta(batch: Batch, runs: Sequence[Run]) -> TokensGenerated:
    """Runs of one request, one after the other (from ``batch`` and later batches of its
    worker), as one ``TokensGenerated`` from ``batch``'s first token on, not validated again
    (the batches were), as :func:`schemas.trusted.trusted` builds a model: with 2,000 streams
    ``model_construct``'s loop over the fields was a third of an ingress's CPU (tests/schemas pin
    the result to the validated event's)."""
    first = runs[0]
    if len(runs) == 1:
        token_ids, text, logprobs = first.token_ids, first.text, first.logprobs
    else:
        token_ids = tuple(i for run in runs for i in run.token_ids)
        text = "".join(run.text for run in runs)
        logprobs = tuple(p for run in runs for p in run.logprobs)
    return trusted(TokensGenerated, {
        "event_id": batch.event_id, "schema_version": 1, "occurred_at": batch.occurred_at,
        "source": batch.source, "request_id": first.request_id, "session_id": None,
        "trace": None, "type": "TokensGenerated", "worker_id": batch.worker_id,
        "index": first.index, "token_ids": token_ids, "text": text, "attempt": first.attempt,
        "logprobs": tuple(map(_logprob, logprobs)) if logprobs else (),
    })  # fmt: skip


def _logprob(entry: Any) -> TokenLogprob:
    """A run's log probability as the model's: a lean batch's is a struct (one only where the
    request asked for them: the common run has none)."""
    if isinstance(entry, TokenLogprob):
        return entry
    top = tuple(trusted(TopLogprob, msgspec.structs.asdict(t)) for t in entry.top)
    return trusted(TokenLogprob, {"token": entry.token, "logprob": entry.logprob, "top": top})
