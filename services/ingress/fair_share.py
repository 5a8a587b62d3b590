"""Weighted fair share of one pool's room among tenants (issue 41): who may take free room, and
which tenant's waiter gets it first.

A tenant is active while it has requests here, in flight or waiting, or had some within the
last ``window_s``; its share is the pool's capacity times its weight over the active tenants'
weights, and its demand the most requests it held and queued here at once over that window.
Room is held back for every active tenant below its share, up to its demand (what it recently
used), from the tenants that use more of their share than it does: so a tenant within its share
finds its room free when its next request comes, however many requests a tenant far over its
share keeps waiting, while room no one below their share needs goes to anyone. Among waiters,
the tenant using least of its share goes first.

Each ingress replica counts its own requests by tenant. The other replicas' requests it sees
only as a number (services.ingress.admission) and counts as its tenants' in proportion to their
demand here: a load balancer spreads a tenant's connections over the replicas, so what a heavy
tenant holds elsewhere is not mistaken for a light tenant's need here. Fairness across replicas
is each replica's own.

With one tenant active (no API keys: the tenant None) none of this holds anyone back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

Tenant = str | None


class Peak:
    """The highest value a count took over the last ``window_s`` seconds (a monotonic deque:
    each sample is larger than every later one)."""

    __slots__ = ("_clock", "_samples", "_window_s")

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def record(self, value: int) -> None:
        samples = self._samples
        while samples and samples[-1][1] <= value:
            samples.pop()
        samples.append((self._clock(), value))

    def peak(self, now_value: int) -> int:
        horizon = self._clock() - self._window_s
        samples = self._samples
        # The newest sample stays: it is the current value until the next change.
        while len(samples) > 1 and samples[0][0] < horizon:
            samples.popleft()
        return max(now_value, samples[0][1]) if samples else now_value


class _Tenant:
    __slots__ = ("demand", "held", "queued", "weight")

    def __init__(self, weight: float, window_s: float, clock: Callable[[], float]) -> None:
        self.weight = weight
        self.held = 0
        self.queued = 0
        self.demand = Peak(window_s, clock)


class _Standing:
    """One active tenant as a decision sees it: the share of its weight it uses (its requests
    here and its part of the other replicas'), and the room held back for it."""

    __slots__ = ("reserve", "usage")

    def __init__(self, usage: float, reserve: float) -> None:
        self.usage = usage
        self.reserve = reserve


class FairShare:
    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._tenants: dict[Tenant, _Tenant] = {}

    def count(self, tenant: Tenant, held: int = 0, queued: int = 0) -> None:
        """A change in the tenant's requests in flight (``held``) or waiting (``queued``)."""
        state = self._tenants[tenant]
        state.held += held
        state.queued += queued
        state.demand.record(state.held + state.queued)

    def arrived(self, tenant: Tenant, weight: float) -> None:
        """A request of ``tenant``, whose key gives it ``weight``: it is active, and wants one
        more room than it holds and waits for."""
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(weight, self._window_s, self._clock)
        state.weight = weight
        state.demand.record(state.held + state.queued + 1)

    def may_take(self, tenant: Tenant, free: int, others: int, capacity: int) -> bool:
        """Whether ``tenant`` may take one of ``free`` rooms: what is left after it covers the
        room held back for every tenant using less of its share. ``others``: the other
        replicas' requests in the pool."""
        return _may_take(self._standings(others, capacity), tenant, free)

    def contended(self) -> bool:
        """Whether more than one tenant is active: shares then hold."""
        return len(self._demands()) > 1

    def first(self, tenants: Iterable[Tenant], free: int, others: int, capacity: int) -> Tenant:
        """Of the tenants waiting, the one using least of its share that may take room; raises
        LookupError if none may."""
        standing = self._standings(others, capacity)
        for tenant in sorted(tenants, key=lambda t: standing[t].usage):
            if _may_take(standing, tenant, free):
                return tenant
        raise LookupError("no waiting tenant may take room")

    def most_over(self, tenants: Iterable[Tenant], others: int, capacity: int) -> Tenant:
        """Of the tenants waiting, the one using most of its share."""
        standing = self._standings(others, capacity)
        return max(tenants, key=lambda t: standing[t].usage)

    def _demands(self) -> dict[Tenant, int]:
        """The active tenants' demands (forgetting the tenants no longer active)."""
        demands: dict[Tenant, int] = {}
        for tenant, state in list(self._tenants.items()):
            demand = state.demand.peak(state.held + state.queued)
            if demand:
                demands[tenant] = demand
            else:  # nothing here for a whole window: no longer active
                del self._tenants[tenant]
        return demands

    def _standings(self, others: int, capacity: int) -> dict[Tenant, _Standing]:
        demands = self._demands()
        if len(demands) < 2:
            return {t: _Standing(0.0, 0.0) for t in demands}
        weights = sum(self._tenants[t].weight for t in demands)
        wanted = sum(demands.values())
        standing: dict[Tenant, _Standing] = {}
        for tenant, demand in demands.items():
            state = self._tenants[tenant]
            holds = state.held + others * demand / wanted
            share = capacity * state.weight / weights
            standing[tenant] = _Standing(holds / state.weight, max(0.0, min(share, demand) - holds))
        return standing


def _may_take(standing: dict[Tenant, _Standing], tenant: Tenant, free: int) -> bool:
    mine = standing[tenant].usage
    held_back = sum(s.reserve for t, s in standing.items() if t != tenant and s.usage < mine)
    return held_back <= free - 1
