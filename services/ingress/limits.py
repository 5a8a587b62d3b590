"""Per-tenant request limits of one ingress process: a request rate (a token bucket holding one
second's worth, so a tenant may burst that much) and a count of requests in flight.

Each ingress replica keeps its own counts: behind N replicas a tenant gets up to N times its
limits, which the README says.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rate_per_s: float | None = None
    """Requests a second; None: no limit."""
    max_concurrency: int | None = None
    """Requests in flight at once; None: no limit."""


_UNLIMITED = TenantLimits()


class TokenBucket:
    __slots__ = ("_clock", "_last", "_tokens", "burst", "rate")

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = max(1.0, rate)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def take(self) -> float:
        """0.0 if a request may go now (and it is counted); else seconds until one may."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class TenantGate:
    """Admits or refuses each tenant's next request; ``leave`` must follow every admission."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._limits: dict[str, TenantLimits] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        """The limits now in force; a tenant whose rate is unchanged keeps its bucket's state
        (a key added or revoked elsewhere must not refill anyone's bucket)."""
        self._limits = limits
        kept = {}
        for tenant, limit in limits.items():
            bucket = self._buckets.get(tenant)
            if limit.rate_per_s is not None:
                if bucket is None or bucket.rate != limit.rate_per_s:
                    bucket = TokenBucket(limit.rate_per_s, self._clock)
                kept[tenant] = bucket
        self._buckets = kept

    def enter(self, tenant: str) -> int | None:
        """None: admitted. Else refused, with the whole seconds to wait (``Retry-After``)."""
        limit = self._limits.get(tenant, _UNLIMITED)
        running = self._in_flight.get(tenant, 0)
        if limit.max_concurrency is not None and running >= limit.max_concurrency:
            # When one ends is not known; a second is what a client should wait at least.
            return 1
        bucket = self._buckets.get(tenant)
        wait = bucket.take() if bucket is not None else 0.0
        if wait > 0.0:
            return max(1, math.ceil(wait))
        self._in_flight[tenant] = running + 1
        return None

    def leave(self, tenant: str) -> None:
        running = self._in_flight.get(tenant, 0) - 1
        if running > 0:
            self._in_flight[tenant] = running
        else:
            self._in_flight.pop(tenant, None)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)
