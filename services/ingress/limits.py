"""Per-tenant limits, as plain arithmetic over what each ingress replica holds: requests in flight,
recent admissions (the request rate) and the tokens charged in the last minute and day.

A tenant's limits hold for the whole cluster: each replica keeps its own :class:`Holdings` of each
tenant, shares them through etcd (:mod:`services.ingress.shared_limits`), and a request is
admitted only if the sum over every replica's holdings, with it added, stays within the limits.

The rate is a sliding window: at most ``slots`` admissions in any ``window_s``, where ``slots`` is
one second's worth (at least one) and ``window_s = slots / rate``. So a tenant may burst one
second's worth, as a token bucket of that depth would let it, and averages its rate. Admissions
are kept in tenths of a second, so a replica's record stays small at any rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

# Admissions and token charges are kept per tenth of a second, per second and per hour.
_TICK_S = 0.1
MINUTE_S = 60.0
DAY_S = 86_400.0
_HOUR_S = 3_600.0
# The most slots in flight, and admissions, a replica holds in reserve for a tenant; how long
# reserved admissions may be taken for.
SPARE_CAP = 8
SPARE_HOLD_S = 0.25
# Each token record's bucket width and window.
_BUCKETS = {"minute": (1.0, MINUTE_S), "day": (_HOUR_S, DAY_S)}


@dataclass(frozen=True, slots=True)
class TenantLimits:
    rate_per_s: float | None = None
    """Requests a second; None: no limit."""
    max_concurrency: int | None = None
    """Requests in flight at once; None: no limit."""
    tokens_per_minute: int | None = None
    """Prompt plus completion tokens in any minute; None: no limit."""
    tokens_per_day: int | None = None
    """The same over any day (kept per hour: a charge leaves the day on the hour)."""

    @property
    def exclusive(self) -> bool:
        """Whether an admission must be claimed against the other replicas' at once (in flight
        and rate); token quotas are charged after the fact and need no claim."""
        return self.rate_per_s is not None or self.max_concurrency is not None

    @property
    def metered(self) -> bool:
        """Whether it has a token quota (read at admission, charged as requests end)."""
        return self.tokens_per_minute is not None or self.tokens_per_day is not None

    @property
    def any(self) -> bool:
        return self.exclusive or self.metered

    @property
    def rate_slots(self) -> int:
        assert self.rate_per_s is not None
        return max(1, int(self.rate_per_s))

    @property
    def rate_window_s(self) -> float:
        assert self.rate_per_s is not None
        return self.rate_slots / self.rate_per_s

    def share(self, replicas: int) -> TenantLimits:
        """One replica's part of the limits when it cannot see the others': a 1/``replicas``
        share, never unlimited and at least one request (a limit below the replica count then
        lets each replica that one)."""
        if replicas <= 1:
            return self

        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, limit // replicas)

        rate = None if self.rate_per_s is None else self.rate_per_s / replicas
        return TenantLimits(
            rate,
            part(self.max_concurrency),
            part(self.tokens_per_minute),
            part(self.tokens_per_day),
        )


@dataclass(slots=True)
class Holdings:
    """What one replica holds of one tenant; its record in etcd is :meth:`to_json`'s."""

    running: int = 0
    admitted: dict[int, int] = field(default_factory=dict)
    """Admissions per tenth of a second (wall clock), for the rate."""
    minute: dict[int, int] = field(default_factory=dict)
    """Tokens charged per second."""
    day: dict[int, int] = field(default_factory=dict)
    """Tokens charged per hour."""
    spare: int = 0
    """Slots in flight held in reserve: counted as held by every replica, taken by this one's
    next requests with no round trip to etcd."""
    rate_spare: int = 0
    """Admissions held in reserve (this replica's own, not in its record): each is counted in
    ``admitted`` at ``spare_until``, so one taken before then is counted for at least every
    window that holds the moment it was taken, and the rate is never passed."""
    spare_until: float = 0.0

    def admit(self, now: float) -> None:
        self.running += 1
        tick = int(now / _TICK_S)
        self.admitted[tick] = self.admitted.get(tick, 0) + 1

    def reserve(self, admissions: int, now: float) -> None:
        """Hold ``admissions`` in reserve for ``SPARE_HOLD_S`` (those not taken stay counted:
        late, never early)."""
        if admissions > 0:
            self.rate_spare, self.spare_until = admissions, now + SPARE_HOLD_S
            tick = int(self.spare_until / _TICK_S)
            self.admitted[tick] = self.admitted.get(tick, 0) + admissions

    def take_spare(self, limits: TenantLimits, now: float) -> bool:
        """Admit a request from the reserve, if it holds what each exclusive limit needs."""
        slot = limits.max_concurrency is None or self.spare > 0
        admission = limits.rate_per_s is None or (self.rate_spare > 0 and now < self.spare_until)
        if not (limits.exclusive and slot and admission):
            return False
        if limits.max_concurrency is not None:
            self.spare -= 1
        if limits.rate_per_s is not None:
            self.rate_spare -= 1
        self.running += 1
        return True

    def drop_spares(self) -> None:
        self.spare = self.rate_spare = 0

    def leave(self, keep_slot: bool = False) -> None:
        """A request ended; ``keep_slot``: its slot stays held, in reserve."""
        if self.running > 0:
            self.running -= 1
            self.spare += keep_slot

    def charge(self, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        second, hour = int(now), int(now / _HOUR_S)
        self.minute[second] = self.minute.get(second, 0) + tokens
        self.day[hour] = self.day.get(hour, 0) + tokens

    def prune(self, now: float, rate_window_s: float = MINUTE_S) -> None:
        """Forget what no window can count any more."""
        oldest_tick = int((now - rate_window_s) / _TICK_S)
        self.admitted = {t: n for t, n in self.admitted.items() if t >= oldest_tick}
        self.minute = {s: n for s, n in self.minute.items() if s + 1 > now - MINUTE_S}
        self.day = {h: n for h, n in self.day.items() if (h + 1) * _HOUR_S > now - DAY_S}

    @property
    def empty(self) -> bool:
        return not (self.running or self.spare or self.admitted or self.minute or self.day)

    def to_json(self) -> dict[str, object]:
        return {
            "running": self.running,
            "spare": self.spare,
            "admitted": _pairs(self.admitted),
            "minute": _pairs(self.minute),
            "day": _pairs(self.day),
        }

    @classmethod
    def from_json(cls, data: object) -> Holdings:
        """A replica's record as etcd holds it; ValueError for anything else."""
        counts = (data.get("running", 0), data.get("spare", 0)) if isinstance(data, dict) else ()
        if not counts or not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            raise ValueError("not a replica's holdings")
        assert isinstance(data, dict)
        return cls(
            max(0, counts[0]),
            _unpairs(data.get("admitted", [])),
            _unpairs(data.get("minute", [])),
            _unpairs(data.get("day", [])),
            spare=max(0, counts[1]),
        )

    def copy(self) -> Holdings:
        return replace(
            self, admitted=dict(self.admitted), minute=dict(self.minute), day=dict(self.day)
        )


def _pairs(counts: dict[int, int]) -> list[list[int]]:
    return [[k, v] for k, v in sorted(counts.items())]


def _unpairs(data: object) -> dict[int, int]:
    if not isinstance(data, list):
        raise ValueError("not a list of [time, count] pairs")
    counts: dict[int, int] = {}
    for pair in data:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        ):
            raise ValueError("not a [time, count] pair")
        counts[pair[0]] = counts.get(pair[0], 0) + max(0, pair[1])
    return counts


def refusal(
    limits: TenantLimits, held: Iterable[Holdings], now: float, prompt_tokens: int = 0
) -> int | None:
    """None if one more request fits within ``limits`` beside every replica's ``held``; else the
    whole seconds until one may (``Retry-After``). ``prompt_tokens``: the request's, counted
    against the token quotas with what is charged already."""
    held = list(held)
    waits: list[float] = []
    running = sum(h.running + h.spare for h in held)
    if limits.max_concurrency is not None and running >= limits.max_concurrency:
        # When one ends is not known; a second is what a client should wait at least.
        waits.append(1.0)
    if limits.rate_per_s is not None:
        waits.append(_rate_wait(limits, held, now))
    quotas = ((limits.tokens_per_minute, "minute"), (limits.tokens_per_day, "day"))
    for quota, kept in quotas:
        if quota is not None:
            width, window = _BUCKETS[kept]
            charged = _merged((getattr(h, kept) for h in held), width, window, now)
            waits.append(_quota_wait(charged, quota, prompt_tokens, now, width, window))
    wait = max(waits, default=0.0)
    return None if wait <= 0.0 else max(1, math.ceil(wait))


def spare_slots(limits: TenantLimits, held: list[Holdings], replicas: int) -> int:
    """How many more slots in flight a replica may hold in reserve beside ``held`` (its own
    included): only while the tenant holds at most half its concurrency limit, a part of the rest
    of that half per replica, and only for a limit of ``2 * SPARE_CAP`` or more. So a tenant far
    below its limit is admitted with no round trip to etcd, and near it (or with a limit of a
    few) every request is claimed, exactly."""
    limit = limits.max_concurrency
    if limit is None or limit < 2 * SPARE_CAP:
        return 0
    used = sum(h.running + h.spare for h in held)
    return min(max(0, (limit // 2 - used) // max(1, replicas)), SPARE_CAP)


def spare_admissions(
    limits: TenantLimits, held: list[Holdings], own: Holdings, now: float, replicas: int
) -> int:
    """How many admissions a replica may hold in reserve for the next ``SPARE_HOLD_S``, as
    ``spare_slots`` for its rate: also no more than its own admissions of the last window would
    take in that time, so that few go unused (an unused one stays counted until it leaves the
    window)."""
    if limits.rate_per_s is None or limits.rate_slots < 2 * SPARE_CAP:
        return 0
    window = limits.rate_window_s
    used = sum(_merged((h.admitted for h in held), _TICK_S, window, now).values())
    room = (limits.rate_slots // 2 - used) // max(1, replicas)
    mine = sum(_merged([own.admitted], _TICK_S, window, now).values())
    return min(max(0, room), math.ceil(mine * SPARE_HOLD_S / window), SPARE_CAP)


def _rate_wait(limits: TenantLimits, held: list[Holdings], now: float) -> float:
    window = limits.rate_window_s
    ticks = _merged((h.admitted for h in held), _TICK_S, window, now)
    over = sum(ticks.values()) - limits.rate_slots + 1
    if over <= 0:
        return 0.0
    # The window must lose ``over`` admissions (no more than it holds): wait until the tick
    # holding the last of them leaves it.
    return _until_gone(ticks, over, _TICK_S) + window - now


def _quota_wait(
    charged: dict[int, int], quota: int, prompt_tokens: int, now: float, width: float, window: float
) -> float:
    """Seconds until ``prompt_tokens`` more (at least one) fit under ``quota`` beside
    ``charged`` (tokens by their bucket of ``width`` seconds)."""
    over = sum(charged.values()) + max(1, prompt_tokens) - quota
    if over <= 0:
        return 0.0
    if prompt_tokens > quota:
        return window  # never fits; the client is told to wait the window out, not loop
    # As many as are over (no more than are charged: the request alone fits) must leave it.
    return _until_gone(charged, over, width) + window - now


def _until_gone(counts: dict[int, int], many: int, width: float) -> float:
    """When the bucket holding the ``many``-th oldest count ends (``many`` <= all counts)."""
    gone = 0
    for bucket in sorted(counts):
        gone += counts[bucket]
        if gone >= many:
            break
    return (bucket + 1) * width


def _merged(
    counts: Iterable[dict[int, int]], width: float, window: float, now: float
) -> dict[int, int]:
    """The buckets (of ``width`` seconds) still in the ``window`` before ``now``, summed."""
    merged: dict[int, int] = {}
    for each in counts:
        for bucket, n in each.items():
            if (bucket + 1) * width > now - window:
                merged[bucket] = merged.get(bucket, 0) + n
    return merged
