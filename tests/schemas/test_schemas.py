from __future__ import annotations

import typing

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from schemas import codec
from schemas.block_hash import chain_block_hashes, hash_block
from schemas.deltas import runs_delta
from schemas.events import (
    Envelope,
    Event,
    KvBlocksRemoved,
    KvCleared,
    PrefillPlacement,
    RouteDecided,
    TokenBatch,
    TokenRun,
    TokensGenerated,
)
from tests.schemas.examples import EXAMPLES


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: e.type)
def test_every_event_round_trips(event: object) -> None:
    assert codec.decode_event(codec.encode(event)) == event  # type: ignore[arg-type]


def test_every_kind_of_event_has_an_example() -> None:
    """The round trip covers every member of the events' union, the day one is added."""
    (union, _) = typing.get_args(Event)
    kinds = {kind.__name__ for kind in typing.get_args(union)}
    assert kinds == {type(event).__name__ for event in EXAMPLES}


def test_events_are_frozen_and_strict() -> None:
    event = EXAMPLES[0]
    with pytest.raises(ValidationError):
        event.request_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        KvCleared(source="s", worker_id="w", seq=1, surprise=True)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        KvBlocksRemoved(source="s", worker_id="w", seq=1, block_hashes=(2**64,))


# Fields whose name says what they hold, to anyone who has read one event.
SELF_EXPLANATORY = {
    *("worker_id", "from_worker_id", "to_worker_id", "block_hashes", "token_ids", "seq"),
    *("reason", "code", "message", "finish_reason", "role", "kv_blocks_used", "kv_blocks_total"),
}


def _models(annotation: object) -> list[type[BaseModel]]:
    """The models a field's type is made of (through tuples, unions and annotations)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def test_every_field_is_documented_or_self_explanatory() -> None:
    """Each event says what it is, and each of its fields what it holds: by a description, by
    its name, or by its model's own docstring."""
    undocumented = []
    for kind in {type(event) for event in EXAMPLES}:
        assert kind.__doc__, kind.__name__
        for name, field in kind.model_fields.items():
            if name in Envelope.model_fields or name == "type" or field.description:
                continue
            models = _models(field.annotation)
            if name not in SELF_EXPLANATORY and not (models and all(m.__doc__ for m in models)):
                undocumented.append(f"{kind.__name__}.{name}")
    assert undocumented == []


def test_old_versions_are_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    # A version-0 KvCleared named the worker "node"; the upcaster renames it.
    raw = orjson.loads(codec.encode(EXAMPLES[11]))
    raw["schema_version"] = 0
    raw["node"] = raw.pop("worker_id")

    def v0_to_v1(old: dict[str, object]) -> dict[str, object]:
        new = dict(old)
        new["worker_id"] = new.pop("node")
        return new

    monkeypatch.setitem(codec.UPCASTERS, ("KvCleared", 0), v0_to_v1)
    assert codec.decode_event(orjson.dumps(raw)) == EXAMPLES[11]


def test_a_version_1_route_decision_reads_score_as_cost() -> None:
    route = EXAMPLES[1]
    assert isinstance(route, RouteDecided)
    placement = PrefillPlacement(
        prefill_worker_id="p", local_ms=2.0, reason="r", candidates=route.candidates
    )
    current = route.model_copy(update={"prefill": placement})
    raw = orjson.loads(codec.encode(current))
    raw["schema_version"] = 1
    for candidate in [*raw["candidates"], *raw["prefill"]["candidates"]]:
        candidate["score"] = candidate.pop("cost")
    assert codec.decode_event(orjson.dumps(raw)) == current


def test_an_older_version_in_the_current_shape_is_upcast(monkeypatch: pytest.MonkeyPatch) -> None:
    # Parses as the current KvCleared, but names version 0: its upcaster must still run.
    raw = orjson.loads(codec.encode(EXAMPLES[11]))
    raw["schema_version"] = 0
    monkeypatch.setitem(codec.UPCASTERS, ("KvCleared", 0), lambda old: {**old, "seq": 77})
    decoded = codec.decode_event(orjson.dumps(raw))
    assert decoded == EXAMPLES[11].model_copy(update={"seq": 77})


def test_a_route_decision_naming_no_version_is_version_1(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = orjson.loads(codec.encode(EXAMPLES[1]))
    del raw["schema_version"]
    for candidate in raw["candidates"]:
        candidate["score"] = candidate.pop("cost")
    assert codec.decode_event(orjson.dumps(raw)) == EXAMPLES[1]
    # Even in a shape the current version reads, its version-1 upcaster runs.
    raw["candidates"] = []
    monkeypatch.setitem(codec.UPCASTERS, ("RouteDecided", 1), lambda old: {**old, "reason": "up"})
    decoded = codec.decode_event(orjson.dumps(raw))
    assert isinstance(decoded, RouteDecided) and decoded.reason == "up"


def test_block_hashes_chain_the_prefix() -> None:
    a = chain_block_hashes([1, 2, 3, 4, 5], 2)
    b = chain_block_hashes([1, 2, 3, 4, 9, 9], 2)
    c = chain_block_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and len(b) == 3  # partial blocks get no hash
    assert a == b[:2]
    assert a[1] != c[1]  # same block, different prefix
    assert a[0] == hash_block(0, [1, 2])
    assert all(0 <= h < 2**64 for h in a + b + c)


def test_block_hash_reads_bytes_as_token_ids() -> None:
    assert hash_block(5, b"\x01\x02") == hash_block(5, [1, 2]) == hash_block(5, bytearray([1, 2]))


def test_a_batch_s_run_is_the_tokens_generated_event_it_stands_for() -> None:
    batch = EXAMPLES[-1]
    assert isinstance(batch, TokenBatch)
    (run,) = batch.runs
    delta = runs_delta(batch, (run,))
    validated = TokensGenerated(
        event_id=batch.event_id,
        occurred_at=batch.occurred_at,
        source=batch.source,
        request_id=run.request_id,
        worker_id=batch.worker_id,
        index=run.index,
        token_ids=run.token_ids,
        text=run.text,
    )
    assert delta == validated and codec.encode(delta) == codec.encode(validated)
    joined = delta.model_copy(update={"text": "ab"})
    assert joined.text == "ab" and delta.text == "a"
    later = TokenRun(request_id="r1", index=1, token_ids=(6, 7), text="bc")
    both = runs_delta(batch, (run, later))
    assert (both.index, both.token_ids, both.text) == (0, (5, 6, 7), "abc")
