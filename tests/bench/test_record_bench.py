"""The recording benchmark's trimmed route event is the v2 event: the same decision less every
field v3 added, which the codec reads back as their defaults."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from benchmarks.record_bench import (
    FULL,
    TRIMMED,
    V3_CANDIDATE_FIELDS,
    V3_EVENT_FIELDS,
    route_path,
)
from schemas import codec
from schemas.events import RouteCandidate, RouteDecided
from services.planner.kv_policy import KvAware
from tests.planner.recorded import recorded


def _defaults(model: type[BaseModel], names: frozenset[str]) -> dict[str, Any]:
    return {name: model.model_fields[name].default for name in names}


def test_the_trimmed_event_is_the_full_one_less_what_v3_added() -> None:
    event = recorded(KvAware())
    prefill = event.prefill
    assert prefill is not None and prefill.candidates  # both kinds of candidate are trimmed
    full, trimmed = route_path(FULL, event)(), route_path(TRIMMED, event)()
    assert full == codec.encode(event)
    assert len(trimmed) < len(full)

    def v2(candidates: tuple[RouteCandidate, ...]) -> tuple[RouteCandidate, ...]:
        return tuple(
            c.model_copy(update=_defaults(RouteCandidate, V3_CANDIDATE_FIELDS)) for c in candidates
        )

    assert codec.decode_event(trimmed) == event.model_copy(
        update={
            **_defaults(RouteDecided, V3_EVENT_FIELDS),
            "candidates": v2(event.candidates),
            "prefill": prefill.model_copy(update={"candidates": v2(prefill.candidates)}),
        }
    )
