"""Every attempt asks the planner to avoid the workers its ingress hears late or not at all,
after those its earlier attempts left, eight at most."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas.events import RequestSpec, SamplingParams
from services.ingress.migration import AVOID_AT_MOST, avoiding


def spec(avoid: tuple[str, ...] = ()) -> RequestSpec:
    return RequestSpec(
        model="m",
        prompt_token_ids=(1, 2),
        block_size=16,
        block_hashes=(),
        sampling=SamplingParams(max_tokens=4),
        reply_to="i",
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
        avoid_workers=avoid,
    )


def test_the_unheard_join_the_workers_left_and_nothing_is_copied_for_none() -> None:
    plain = spec()
    assert avoiding(plain, set()) is plain
    assert avoiding(plain, {"z", "y"}).avoid_workers == ("y", "z")
    moved = spec(("w1",))
    assert avoiding(moved, {"w1"}) is moved
    assert avoiding(moved, {"z", "w1"}).avoid_workers == ("w1", "z")
    many = avoiding(moved, {f"u{i:02}" for i in range(20)})
    assert len(many.avoid_workers) == AVOID_AT_MOST and many.avoid_workers[0] == "w1"
    RequestSpec.model_validate(many.model_dump())
    # An id no worker name holds is left out rather than make the request invalid.
    assert avoiding(plain, {"x" * 65, ""}) is plain
