"""Events written by orjson from their fields (schemas.plain): pydantic's bytes exactly, and
pydantic's own writing wherever the fields do not promise that."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field, field_serializer

from schemas import codec
from schemas.events import (
    KvChanged,
    PlannerConfigured,
    RemovedRun,
    RequestAccepted,
    RequestFinished,
    RequestSpec,
    RouteCandidate,
    SamplingParams,
    StoredRun,
    Usage,
)
from schemas.latency import LatencyHistogram
from schemas.messages import OverlapReplies, OverlapReply
from schemas.plain import plain, to_json
from tests.helpers import registration, routed
from tests.schemas.examples import EXAMPLES


def _pydantic(model: BaseModel) -> bytes:
    return model.__pydantic_serializer__.to_json(model)


ODD_TEXT = 'quote " back \\ ctl \x01\x1f del \x7f sep \u2028 é 😀 \ud7ff'
SPEC = RequestSpec(
    model=ODD_TEXT,
    prompt_token_ids=(0, 1, 2**31),
    block_size=16,
    block_hashes=(0, 2**63, 2**64 - 1),
    sampling=SamplingParams(
        max_tokens=3, temperature=0.1 + 0.2, top_p=1e-7, seed=-(2**63), stop=("\n", "")
    ),
    reply_to="i",
    deadline=datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
    tenant=None,
)
FINISHED = RequestFinished(
    source="worker/w",
    worker_id="w",
    finish_reason="stop",
    usage=Usage(prompt_tokens=3, completion_tokens=2),
    ttft_ms=1.5,
    e2e_ms=1e22,
    token_gaps=LatencyHistogram(counts={0: 1, 117: 2}),
)
KV = KvChanged(
    source="worker/w",
    worker_id="w",
    seq=9,
    changes=(
        StoredRun(parent_hash=None, block_hashes=(1, 2**64 - 1)),
        RemovedRun(block_hashes=(3,), tier="host"),
    ),
)
CANDIDATES = (
    RouteCandidate(worker_id="w", cached_blocks=1, running=2, waiting=3, kv_usage=1.0,
                   cost=float("inf"), predicted_queue_ms=5e-324, node="n"),
    RouteCandidate(worker_id="v", cached_blocks=0, running=0, waiting=0, kv_usage=0.0,
                   cost=-0.0, predicted_prefill_ms=float("nan")),
)  # fmt: skip
SAMPLES: list[BaseModel] = [
    # But a planner's start, off the request path, whose settings pydantic writes.
    *(e for e in EXAMPLES if not isinstance(e, PlannerConfigured)),
    RequestAccepted(source="ingress/i", request_id="r", spec=SPEC),
    routed("r", "w", SPEC).model_copy(update={"candidates": CANDIDATES}),
    FINISHED,
    KV,
    OverlapReplies(replies=(OverlapReply(overlaps={"w": 3}, indexed_blocks=9, host_runs={}),)),
    registration("w"),
]


@pytest.mark.parametrize("model", SAMPLES, ids=lambda m: type(m).__name__)
def test_the_request_path_s_events_are_written_as_pydantic_writes_them(model: BaseModel) -> None:
    assert plain(type(model)), type(model).__name__
    assert to_json(model) == _pydantic(model) == codec.encode(model)


@pytest.mark.parametrize(
    "when",
    [
        datetime(2026, 1, 1, tzinfo=UTC),
        datetime(2026, 1, 1, 1, 2, 3, 4),  # naive
        datetime(2026, 1, 1, 1, 2, 3, 999999, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        # As pydantic reads one back: its own tzinfo class.
        RequestAccepted.model_validate_json(_pydantic(SAMPLES[-6])).occurred_at,
    ],
)
def test_times_are_written_as_pydantic_writes_them(when: datetime) -> None:
    event = RequestAccepted(source="ingress/i", spec=SPEC, occurred_at=when)
    assert to_json(event) == _pydantic(event)


def test_models_that_pydantic_writes_its_own_way_are_left_to_it() -> None:
    class Renamed(BaseModel):
        model_config = ConfigDict(frozen=True)
        name: str = Field(serialization_alias="Name")

    class Shown(BaseModel):
        when: datetime

        @field_serializer("when")
        def _epoch(self, when: datetime) -> float:
            return when.timestamp()

    class Hidden(BaseModel):
        secret: str = Field(exclude=True)

    class Loose(BaseModel):
        model_config = ConfigDict(extra="allow")
        name: str

    class Anything(BaseModel):
        value: Any

    class Holder(BaseModel):
        inner: Hidden

    samples: list[BaseModel] = [
        Renamed(name="a"),
        Shown(when=datetime(2026, 1, 1, tzinfo=UTC)),
        Hidden(secret="s"),
        Loose(name="a", more=1),  # type: ignore[call-arg]
        Anything(value={1, 2}),
        Holder(inner=Hidden(secret="s")),
        PlannerConfigured(
            source="planner/p", policy="kv", seed=1, kv={"a": (1, 2)}, disagg={}, version="v"
        ),
    ]
    for model in samples:
        assert not plain(type(model)), type(model).__name__
        assert to_json(model) == _pydantic(model)


def test_a_value_the_annotation_does_not_promise_is_written_by_pydantic() -> None:
    class Base(BaseModel):
        name: str

    class Sub(Base):
        more: int

    class Holder(BaseModel):
        inner: Base

    # pydantic writes a subclass's value as the declared class: only its fields.
    held = Holder(inner=Sub(name="a", more=1))
    assert not plain(Holder)
    assert to_json(held) == _pydantic(held) == b'{"inner":{"name":"a"}}'
    # A str pydantic's constructor was not asked to check (model_construct): pydantic's way.
    odd = RequestAccepted.model_construct(**{**SAMPLES[-6].__dict__, "source": "\ud800"})
    with pytest.raises(Exception) as raised:
        _pydantic(odd)
    with pytest.raises(type(raised.value)):
        to_json(odd)
