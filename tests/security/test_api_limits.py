"""Per-tenant limits (services.ingress.limits) on a clock the test moves."""

from __future__ import annotations

from services.ingress.limits import TenantGate, TenantLimits, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_bursts_one_second_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(4.0, clock)
    assert [bucket.take() for _ in range(4)] == [0.0] * 4
    assert bucket.take() == 0.25
    clock.now += 0.25
    assert bucket.take() == 0.0
    assert bucket.take() > 0.0


def test_slow_rate_bursts_one_and_waits_its_period() -> None:
    clock = Clock()
    bucket = TokenBucket(0.1, clock)
    assert bucket.take() == 0.0
    assert abs(bucket.take() - 10.0) < 1e-9


def test_concurrency_limit_refuses_until_one_leaves() -> None:
    gate = TenantGate(Clock())
    gate.set_limits({"acme": TenantLimits(max_concurrency=2)})
    assert gate.enter("acme") is None
    assert gate.enter("acme") is None
    assert gate.enter("acme") == 1
    assert gate.enter("other") is None  # no limits: counted, never refused
    gate.leave("acme")
    assert gate.enter("acme") is None
    assert gate.in_flight("acme") == 2


def test_rate_refusal_says_whole_seconds_to_wait() -> None:
    clock = Clock()
    gate = TenantGate(clock)
    gate.set_limits({"acme": TenantLimits(rate_per_s=0.5)})
    assert gate.enter("acme") is None
    gate.leave("acme")
    assert gate.enter("acme") == 2
    # A refused request holds no slot.
    assert gate.in_flight("acme") == 0
    clock.now += 2.0
    assert gate.enter("acme") is None


def test_new_limits_keep_an_unchanged_bucket_drained() -> None:
    clock = Clock()
    gate = TenantGate(clock)
    gate.set_limits({"acme": TenantLimits(rate_per_s=1.0)})
    assert gate.enter("acme") is None
    gate.set_limits({"acme": TenantLimits(rate_per_s=1.0), "new": TenantLimits()})
    assert gate.enter("acme") == 1
    gate.set_limits({"acme": TenantLimits(rate_per_s=2.0)})
    assert gate.enter("acme") is None
