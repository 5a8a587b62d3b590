"""The lean read of a token batch (msgspec, derived from the pydantic model): the same values as
the model's decode, and never taking a payload the model refuses."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from schemas import codec
from schemas.deltas import lean_batch, runs_delta
from schemas.events import TokenBatch, TokenRun, TraceContext
from schemas.lean import struct_of
from schemas.logprobs import TokenLogprob, TopLogprob


def _batch(**fields: Any) -> TokenBatch:
    runs = (
        TokenRun(request_id="a" * 32, attempt=1, index=7, token_ids=(5, 6), text="hé"),
        TokenRun(request_id="b" * 32, index=0, token_ids=(), text=""),
        # A request that asked for log probabilities: the lean read builds them as models.
        TokenRun(
            request_id="c" * 32,
            index=2,
            token_ids=(9,),
            text="x",
            logprobs=(
                TokenLogprob(
                    token="x",
                    logprob=-0.25,
                    top=(TopLogprob(token_id=9, token="x", logprob=-0.25),),
                ),
            ),
        ),
    )
    return TokenBatch(source="worker/w1", worker_id="w1", runs=runs, **fields)


def _model_takes(data: bytes) -> bool:
    try:
        codec.decode_event(data)
    except (ValidationError, ValueError):
        return False
    return True


@pytest.mark.parametrize(
    "batch",
    [
        _batch(),
        _batch(
            trace=TraceContext(traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),
            request_id="x",
        ),
    ],
)
def test_a_worker_s_batch_reads_as_the_model_reads_it(batch: TokenBatch) -> None:
    data = codec.encode(batch)
    lean = lean_batch(data)
    assert lean is not None
    model = codec.decode_event(data)
    assert isinstance(model, TokenBatch)
    for name in ("event_id", "occurred_at", "source", "worker_id"):
        assert getattr(lean, name) == getattr(model, name)
    assert [runs_delta(lean, (run,)) for run in lean.runs] == [
        runs_delta(model, (run,)) for run in model.runs
    ]


def _mutated(path: tuple[Any, ...], value: Any) -> bytes:
    raw = orjson.loads(codec.encode(_batch()))
    *parents, last = path
    target = raw
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return orjson.dumps(raw)


RUN = ("runs", 0)
MUTATIONS = [
    ((*RUN, "request_id"), "r" * 65),  # longer than the model allows
    ((*RUN, "request_id"), 7),
    ((*RUN, "index"), -1),
    ((*RUN, "attempt"), -1),
    ((*RUN, "index"), 3.0),
    ((*RUN, "index"), True),
    ((*RUN, "index"), "3"),
    ((*RUN, "token_ids"), [1, "2"]),
    ((*RUN, "token_ids"), [1, 2.5]),
    ((*RUN, "token_ids"), "12"),
    ((*RUN, "text"), 5),
    ((*RUN, "text"), None),
    ((*RUN, "extra"), 1),
    ((*RUN, "text"), KeyError),
    ((*RUN, "attempt"), KeyError),  # the model's default: only the model may fill it in
    (("runs",), {"0": 1}),
    (("runs",), None),
    (("worker_id",), None),
    (("extra",), 1),
    (("type",), "TokensGenerated"),
    (("schema_version",), 2),
    (("occurred_at",), "yesterday"),
    (("occurred_at",), KeyError),
    (("trace",), {"traceparent": 1}),
    (("trace",), {"traceparent": "x", "other": 1}),
    (("source",), KeyError),
]


@pytest.mark.parametrize(("path", "value"), MUTATIONS)
def test_the_lean_read_takes_nothing_the_model_refuses(path: tuple[Any, ...], value: Any) -> None:
    data = _mutated(path, value)
    if lean_batch(data) is not None:
        assert _model_takes(data), data
        model = codec.decode_event(data)
        lean = lean_batch(data)
        assert lean is not None and isinstance(model, TokenBatch)
        assert [runs_delta(lean, (r,)) for r in lean.runs] == [
            runs_delta(model, (r,)) for r in model.runs
        ]


def test_out_of_range_and_mistyped_runs_are_refused() -> None:
    for path, value in MUTATIONS[:12]:
        assert lean_batch(_mutated(path, value)) is None, (path, value)
    assert lean_batch(b"not json") is None and lean_batch(b'{"type": "TokenBatch"}') is None
    lone_surrogate = codec.encode(_batch()).replace("hé".encode(), b"\\ud800")
    assert lean_batch(lone_surrogate) is None and not _model_takes(lone_surrogate)


def test_a_strings_pattern_carries_over() -> None:
    class Pattern(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(pattern="^a+$")

    decode = msgspec.json.Decoder(struct_of(Pattern)).decode
    assert decode(b'{"name": "aaa"}').name == "aaa"
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"name": "aab"}')


def test_a_model_the_struct_cannot_mirror_exactly_is_refused_at_once() -> None:
    class Multiple(BaseModel):
        model_config = ConfigDict(extra="forbid")
        count: int = Field(multiple_of=2)

    class Checked(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str

        @field_validator("name")
        @classmethod
        def _short(cls, value: str) -> str:
            return value

    class Open(BaseModel):
        name: str

    class Mapping(BaseModel):
        model_config = ConfigDict(extra="forbid")
        names: dict[str, int]

    for model in (Multiple, Checked, Open, Mapping):
        with pytest.raises(TypeError):
            struct_of(model)
