"""Per-tenant limits (services.ingress.limits) as arithmetic over what each replica holds, on a
clock the test moves."""

from __future__ import annotations

import pytest

from services.ingress.limits import (
    SPARE_CAP,
    SPARE_HOLD_S,
    Holdings,
    TenantLimits,
    refusal,
    spare_admissions,
    spare_slots,
)

NOW = 1_000_000.0


def admitted(times: list[float]) -> Holdings:
    held = Holdings()
    for at in times:
        held.admit(at)
        held.leave()
    return held


def test_concurrency_counts_every_replicas_requests() -> None:
    limits = TenantLimits(max_concurrency=4)
    a, b = Holdings(), Holdings()
    for _ in range(2):
        a.admit(NOW)
        b.admit(NOW)
    assert refusal(limits, [a, b], NOW) == 1
    assert refusal(limits, [a], NOW) is None
    b.leave()
    assert refusal(limits, [a, b], NOW) is None


def test_rate_is_one_seconds_worth_in_any_window_with_the_wait_until_one_leaves_it() -> None:
    limits = TenantLimits(rate_per_s=4.0)
    held = [admitted([NOW - 0.95, NOW - 0.5]), admitted([NOW - 0.3, NOW - 0.2])]
    # Four in the last second, across two replicas: the next waits until the oldest leaves.
    assert refusal(limits, held, NOW) == 1
    assert refusal(limits, held, NOW + 0.2) is None  # kept in tenths: up to one late
    assert refusal(limits, held[1:], NOW) is None


def test_slow_rate_allows_one_per_period() -> None:
    limits = TenantLimits(rate_per_s=0.1)
    held = [admitted([NOW])]
    assert refusal(limits, held, NOW + 1) == 10
    assert refusal(limits, held, NOW + 9.9) == 1
    assert refusal(limits, held, NOW + 10.2) is None


def test_token_quota_waits_until_enough_of_the_minute_is_gone() -> None:
    limits = TenantLimits(tokens_per_minute=1000)
    a, b = Holdings(), Holdings()
    a.charge(600, NOW - 50)
    b.charge(400, NOW - 10)
    # Spent: even one more token waits until the oldest charge leaves the minute.
    assert refusal(limits, [a, b], NOW) == 11
    assert refusal(limits, [a], NOW) is None
    # A prompt that would pass the quota waits for room for all of it.
    assert refusal(limits, [a], NOW, prompt_tokens=500) == 11
    assert refusal(limits, [a, b], NOW + 11, prompt_tokens=500) is None
    # One larger than the quota never fits: the client is told to wait the window out.
    assert refusal(limits, [], NOW, prompt_tokens=1001) == 60


def test_daily_quota_counts_the_last_day_by_the_hour() -> None:
    limits = TenantLimits(tokens_per_day=100)
    held = Holdings()
    held.charge(100, NOW)
    wait = refusal(limits, [held], NOW)
    assert wait is not None and 86_400 < wait <= 90_000  # to the end of its hour, and a day
    assert refusal(limits, [held], NOW + 90_000) is None


def test_a_replicas_share_is_never_unlimited() -> None:
    limits = TenantLimits(rate_per_s=10.0, max_concurrency=4, tokens_per_minute=1000)
    assert limits.share(2) == TenantLimits(5.0, 2, 500, None)
    assert limits.share(1) is limits
    assert TenantLimits(max_concurrency=1).share(3).max_concurrency == 1
    assert not TenantLimits().any
    assert TenantLimits(tokens_per_day=5).any and not TenantLimits(tokens_per_day=5).exclusive


def test_a_reserve_only_far_below_a_concurrency_limit_counted_as_held() -> None:
    limits = TenantLimits(max_concurrency=40)
    mine, other = Holdings(), Holdings(running=10)
    mine.admit(NOW)
    # Half the limit is 20; 11 held: the 9 left, split over 2 replicas.
    assert spare_slots(limits, [mine, other], replicas=2) == 4
    mine.spare = 9  # half the limit held: no more
    assert spare_slots(limits, [mine, other], replicas=2) == 0
    assert mine.take_spare(limits, NOW) and (mine.running, mine.spare) == (2, 8)
    mine.leave(keep_slot=True)
    assert (mine.running, mine.spare) == (1, 9)
    # Reserved slots are held: the others are refused at the limit with them.
    assert refusal(TenantLimits(max_concurrency=20), [mine, other], NOW) == 1
    assert spare_slots(TenantLimits(max_concurrency=4), [Holdings(running=1)], 1) == 0
    assert spare_slots(TenantLimits(max_concurrency=10_000), [], 1) == SPARE_CAP


def test_reserved_admissions_are_counted_from_their_reserves_end_and_only_as_used() -> None:
    limits = TenantLimits(rate_per_s=100.0)
    mine = admitted([NOW - 0.5] * 8)
    # 8 of its own in the last second: 2 in the next quarter second, within the room left.
    assert spare_admissions(limits, [mine], mine, NOW, replicas=1) == 2
    mine.reserve(2, NOW)
    # Counted now, and until a second after the reserve's end: never early.
    assert refusal(TenantLimits(rate_per_s=10.0), [mine], NOW) is not None
    assert sum(mine.admitted.values()) == 10
    assert mine.take_spare(limits, NOW + 0.1) and mine.take_spare(limits, NOW + 0.2)
    assert not mine.take_spare(limits, NOW + 0.2)  # both taken
    mine.reserve(1, NOW)
    assert not mine.take_spare(limits, NOW + SPARE_HOLD_S)  # past the reserve's end
    # A small rate is claimed each time; no reserve far past half of it either.
    assert spare_admissions(TenantLimits(rate_per_s=10.0), [mine], mine, NOW, 1) == 0
    busy = admitted([NOW - 0.1] * 60)
    assert spare_admissions(limits, [busy], busy, NOW, 1) == 0


def test_holdings_round_trip_and_forget_what_no_window_counts() -> None:
    held = admitted([NOW - 5, NOW])
    held.spare = 2
    held.admit(NOW)
    held.charge(7, NOW - 70)
    held.charge(3, NOW)
    assert Holdings.from_json(held.to_json()) == held
    held.prune(NOW, rate_window_s=1.0)
    assert sum(held.admitted.values()) == 2
    assert sum(held.minute.values()) == 3
    assert sum(held.day.values()) == 10
    assert held.running == 1 and not held.empty


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"running": "1"},
        {"spare": True},
        {"admitted": [[1]]},
        {"minute": [["1", 2]]},
        {"day": {"1": 2}},
    ],
)
def test_a_record_of_another_shape_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        Holdings.from_json(bad)
