"""Per-tenant limits (services.ingress.limits) as arithmetic over what each replica holds, on a
clock the test moves."""

from __future__ import annotations

import pytest

from services.ingress.limits import Holdings, TenantLimits, refusal

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


def test_holdings_round_trip_and_forget_what_no_window_counts() -> None:
    held = admitted([NOW - 5, NOW])
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
    [[], {"running": "1"}, {"admitted": [[1]]}, {"minute": [["1", 2]]}, {"day": {"1": 2}}],
)
def test_a_record_of_another_shape_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        Holdings.from_json(bad)
