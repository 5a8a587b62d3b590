"""Tenant limits held for the whole cluster, whatever the number of ingress replicas.

Each replica writes what it holds of each limited tenant (:class:`~services.ingress.limits.
Holdings`) to etcd under ``/laneway/tenancy/<tenant>/<replica>``, on a lease of its own, so a
replica that dies gives its requests back within the lease's TTL. To admit a request of a tenant
with a concurrency or rate limit, a replica reads the tenant's records, checks the sum with the
request added, and writes its own record in a transaction that holds only if no record of that
tenant changed since the read: two replicas cannot both take the last slot. Token quotas are
charged after the fact (a request's tokens are known at its end), so they are read, never
claimed, and a burst may pass a quota by what is in flight when it is reached.

etcd away (a claim unanswered within ``claim_timeout_s``, or refused): each replica holds each
tenant to its share, the limits divided by the replicas last seen (``TenantLimits.share``), over
what it holds itself, and logs so once; never unlimited. A probe every ``ttl_s / 3`` seconds finds
etcd back, writes what the replica holds, and the shared limits hold again.

Where there is no etcd (tests, one process), the limits hold over this replica's own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aetcd
from aetcd.utils import prefix_range_end

from bus.registry import UNREACHABLE
from bus.tenancy import REPLICAS_PREFIX, tenant_prefix
from services.ingress.limits import (
    MINUTE_S,
    Holdings,
    TenantLimits,
    refusal,
    spare_admissions,
    spare_slots,
)

log = logging.getLogger(__name__)

_UNLIMITED = TenantLimits()
_RELEASE_DELAY_S = 0.02
# A tenant's reserve (services.ingress.limits.spares) unused this long goes back.
SPARE_IDLE_S = 0.5
_AWAY = (TimeoutError, *UNREACHABLE, aetcd.exceptions.ClientError)


class TenantGate:
    """Admits or refuses each tenant's next request; ``leave`` must follow every admission."""

    def __init__(
        self,
        replica: str = "local",
        store: aetcd.Client | None = None,
        *,
        clock: Callable[[], float] = time.time,
        claim_timeout_s: float = 0.5,
        ttl_s: int = 10,
    ) -> None:
        self._replica = replica
        self._store = store
        self._clock = clock
        self._claim_timeout_s = claim_timeout_s
        self._ttl_s = ttl_s
        self._limits: dict[str, TenantLimits] = {}
        self._own: dict[str, Holdings] = {}
        # The other replicas' records of each tenant as last read (by its last admission).
        self._others: dict[str, list[Holdings]] = {}
        # Each tenant's records as this replica's last write left them, and at which revision.
        self._views: dict[str, _View] = {}
        # When each tenant's reserve was last drawn on or filled (time.monotonic()).
        self._spare_used: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lease: aetcd.Lease | None = None
        self._dirty: set[str] = set()
        self._flush = asyncio.Event()
        self._away = store is None
        self._replicas = 1

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        self._limits = limits

    def in_flight(self, tenant: str) -> int:
        """This replica's requests of ``tenant``."""
        own = self._own.get(tenant)
        return 0 if own is None else own.running

    @property
    def shared(self) -> bool:
        """Whether the limits now hold over every replica's requests (etcd reached)."""
        return not self._away

    async def enter(self, tenant: str, prompt_tokens: int = 0) -> int | None:
        """None: admitted. Else refused, with the whole seconds to wait (``Retry-After``)."""
        limits = self._limits.get(tenant, _UNLIMITED)
        own = self._own.setdefault(tenant, Holdings())
        if limits.any and self._away:
            wait = refusal(limits.share(self._replicas), [own], self._clock(), prompt_tokens)
            if wait is not None:
                return wait
            self._changed(tenant)
        elif limits.any:
            # Far below its limits, the tenant's reserve admits it with no round trip; its token
            # quotas as last read (they are read, never claimed, either way).
            if own.take_spare(limits, self._clock()):
                self._spare_used[tenant] = time.monotonic()
                wait = self.over_quota(tenant, prompt_tokens)
                if wait is not None:
                    self.leave(tenant)
                return wait
            try:
                async with asyncio.timeout(self._claim_timeout_s):
                    return await self._claim(tenant, limits, own, prompt_tokens)
            except _AWAY as exc:
                self._went_away(exc)
                return await self.enter(tenant, prompt_tokens)
        own.admit(self._clock())
        return None

    def over_quota(self, tenant: str, prompt_tokens: int) -> int | None:
        """For a request already admitted, once its prompt is known: None if the prompt fits the
        tenant's token quotas beside what is charged, as last read at its admission (no second
        round trip); else the whole seconds until it would."""
        limits = self._limits.get(tenant, _UNLIMITED)
        if limits.tokens_per_minute is None and limits.tokens_per_day is None:
            return None
        quotas = TenantLimits(
            tokens_per_minute=limits.tokens_per_minute, tokens_per_day=limits.tokens_per_day
        )
        if self._away:
            quotas, others = quotas.share(self._replicas), []
        else:
            others = self._others.get(tenant, [])
        own = self._own.get(tenant, Holdings())
        return refusal(quotas, [*others, own], self._clock(), prompt_tokens)

    def leave(self, tenant: str, tokens: int = 0) -> None:
        """A request of ``tenant`` ended, having used ``tokens`` (prompt and completion)."""
        own = self._own.get(tenant)
        if own is None:
            return
        limits, now = self._limits.get(tenant, _UNLIMITED), self._clock()
        # Still far below its limits: the slot stays this replica's, in reserve, and nothing
        # held changes for the others to hear of.
        keep = not self._away and limits.max_concurrency is not None
        keep = (
            keep and spare_slots(limits, [*self._others.get(tenant, []), own], self._replicas) > 0
        )
        own.leave(keep_slot=keep)
        own.charge(tokens, now)
        if not limits.any:
            if own.running == 0:
                del self._own[tenant]  # an unlimited tenant's holdings are never shared
            return
        quotas = limits.tokens_per_minute is not None or limits.tokens_per_day is not None
        # Written where the others count it: a slot given back, tokens charged to a quota.
        if (limits.max_concurrency is not None and not keep) or (tokens > 0 and quotas):
            self._changed(tenant)

    async def _claim(
        self, tenant: str, limits: TenantLimits, own: Holdings, prompt_tokens: int
    ) -> int | None:
        assert self._store is not None
        store, key, prefix = self._store, self._key(tenant), tenant_prefix(tenant)
        tx = store.transactions
        records = tx.get(prefix, prefix_range_end(prefix))
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            # The records as this replica's last write left them: one round trip, the claim's,
            # while no other replica wrote since. Taken once: stale after any change.
            view, fresh = self._views.pop(tenant, None), False
            # Claims lost to other replicas' writes are tried again (each loss reads the records
            # afresh) for half the claim's time; a request is told to retry in a second only
            # past that, and etcd is never taken for away for it.
            loop = asyncio.get_running_loop()
            contended_until = loop.time() + self._claim_timeout_s / 2
            while loop.time() < contended_until:
                if view is None:
                    found = await store.get_prefix(prefix)
                    view = _View.of(((kv.value, kv) for kv in found), key, found.header.revision)
                    fresh = True
                self._others[tenant] = view.others
                now = self._clock()
                wait = refusal(limits, [*view.others, own], now, prompt_tokens)
                if wait is not None:
                    if fresh:
                        return wait
                    view = None  # refused on an old view: read it afresh first
                    continue
                if not limits.exclusive:  # token quotas only: written with the next flush
                    own.admit(now)
                    self._changed(tenant)
                    return None
                # The claim writes all this replica holds: a release not yet written goes with it.
                carried = tenant in self._dirty
                self._dirty.discard(tenant)
                claimed = own.copy()
                claimed.admit(now)
                held = [*view.others, claimed]
                slots = spare_slots(limits, held, self._replicas)
                admissions = spare_admissions(limits, held, claimed, now, self._replicas)
                claimed.spare += slots
                claimed.reserve(admissions, now)
                claimed.prune(now, _window(limits))
                won, replies = await store.transaction(
                    compare=[
                        tx.mod(prefix, range_end=prefix_range_end(prefix)) < view.revision + 1
                    ],
                    success=[tx.put(key, _encoded(claimed), lease=await self._leased()), records],
                    failure=[records],
                )
                # Either way the reply holds the records as they are now.
                view, fresh = _View.replied(replies[-1], key), True
                if carried and not won:
                    self._dirty.add(tenant)
                if won:
                    # ``own`` itself, not the copy: a request may have left meanwhile.
                    own.admit(now)
                    own.spare += slots
                    own.reserve(admissions, now)
                    self._spare_used[tenant] = time.monotonic()
                    self._keep_view(tenant, view)
                    return None
            return 1

    def _keep_view(self, tenant: str, view: _View | None) -> None:
        if view is not None:
            self._views[tenant] = view

    def _changed(self, tenant: str) -> None:
        self._dirty.add(tenant)
        if not self._away:  # else written once the probe finds etcd back
            self._flush.set()

    def _key(self, tenant: str) -> bytes:
        return tenant_prefix(tenant) + self._replica.encode()

    async def _leased(self) -> aetcd.Lease:
        if self._lease is None:
            assert self._store is not None
            self._lease = await self._store.lease(self._ttl_s)
        return self._lease

    def _went_away(self, exc: BaseException) -> None:
        if not self._away:
            self._away = True
            log.warning(
                "etcd unreachable (%s): tenant limits now hold per ingress replica, each its "
                "1/%d share, until it is back",
                type(exc).__name__,
                self._replicas,
            )
        # Whatever is held now is written once etcd is back; no reserve: the share is all.
        for own in self._own.values():
            own.drop_spares()
        self._dirty.update(self._limited())

    async def run(self) -> None:
        """Keep this replica's records in etcd, written as they change and on a lease kept
        alive; find etcd back when it was away. Forever (nothing to do without etcd)."""
        if self._store is None:
            await asyncio.Event().wait()
        tended = -float(self._ttl_s)
        while True:
            spared = any(own.spare or own.rate_spare for own in self._own.values())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SPARE_IDLE_S if spared else self._ttl_s / 3):
                    await self._flush.wait()
                    # A release waits a little: the tenant's next claim, often just behind it
                    # (a client's next request), writes it in the same transaction. Meanwhile
                    # the others count the request as held: late, never early.
                    await asyncio.sleep(_RELEASE_DELAY_S)
            self._flush.clear()
            self._drop_idle_spares()
            try:
                if self._away or time.monotonic() - tended >= self._ttl_s / 3:
                    async with asyncio.timeout(self._call_timeout_s):
                        await self._tend()
                    tended = time.monotonic()
                await self._write_dirty()
            except _AWAY as exc:
                self._went_away(exc)
                continue
            if self._away:
                self._away = False
                log.warning("etcd reachable again: tenant limits hold across the cluster again")

    async def _tend(self) -> None:
        """Keep the lease alive (or take a new one, writing everything held again, if it lapsed
        while etcd was away) and this replica's mark, and count the replicas."""
        assert self._store is not None
        if self._lease is not None:
            reply = await self._lease.refresh()
            if reply.TTL <= 0:
                self._lease = None
                self._dirty.update(self._limited())
        lease = await self._leased()
        await self._store.put(REPLICAS_PREFIX + self._replica.encode(), b"{}", lease=lease)
        replicas = await self._store.get_prefix(REPLICAS_PREFIX, keys_only=True)
        self._replicas = max(1, len(list(replicas)))

    async def _write_dirty(self) -> None:
        if not self._dirty:
            return
        async with asyncio.timeout(self._call_timeout_s):
            lease = await self._leased()
        while self._dirty:
            tenant = self._dirty.pop()
            try:
                # Each its own bound: many tenants' records are no sign of etcd away.
                async with asyncio.timeout(self._call_timeout_s):
                    await self._write(tenant, lease)
            except BaseException:
                self._dirty.add(tenant)
                raise

    def _drop_idle_spares(self) -> None:
        """A reserve unused for ``SPARE_IDLE_S`` goes back to the tenant: another replica may
        need it."""
        idle = time.monotonic() - SPARE_IDLE_S
        for tenant, own in self._own.items():
            if (own.spare or own.rate_spare) and self._spare_used.get(tenant, 0.0) < idle:
                own.drop_spares()
                self._changed(tenant)

    @property
    def _call_timeout_s(self) -> float:
        return max(1.0, self._claim_timeout_s)

    def _limited(self) -> list[str]:
        return [t for t in self._own if self._limits.get(t, _UNLIMITED).any]

    async def _write(self, tenant: str, lease: aetcd.Lease) -> None:
        assert self._store is not None
        own = self._own.get(tenant)
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            if own is not None:
                own.prune(self._clock(), _window(self._limits.get(tenant, _UNLIMITED)))
            key, prefix = self._key(tenant), tenant_prefix(tenant)
            tx = self._store.transactions
            if own is None or own.empty:
                self._own.pop(tenant, None)
                write = tx.delete(key)
            else:
                write = tx.put(key, _encoded(own), lease=lease)
            # With the records as they are after it: the next claim's view.
            _, replies = await self._store.transaction(
                compare=[], success=[write, tx.get(prefix, prefix_range_end(prefix))], failure=[]
            )
            self._keep_view(tenant, _View.replied(replies[-1], key))

    async def close(self) -> None:
        """Give back what this replica holds at once, not at its lease's end."""
        if self._lease is not None and not self._away:
            with contextlib.suppress(*_AWAY):
                async with asyncio.timeout(1.0):
                    await self._lease.revoke()


@dataclass(frozen=True, slots=True)
class _View:
    """The other replicas' records of a tenant as of an etcd revision."""

    others: list[Holdings]
    revision: int

    @classmethod
    def of(cls, records: Iterable[tuple[bytes, Any]], key: bytes, revision: int) -> _View:
        return cls([_parsed(value) for value, meta in records if meta.key != key], revision)

    @classmethod
    def replied(cls, records: list[tuple[bytes, Any]], key: bytes) -> _View | None:
        """From a transaction's read; None where it read nothing (no revision to go by)."""
        if not records:
            return None
        return cls.of(records, key, records[0][1].header.revision)


def _window(limits: TenantLimits) -> float:
    return limits.rate_window_s if limits.rate_per_s is not None else MINUTE_S


def _encoded(holdings: Holdings) -> bytes:
    return json.dumps(holdings.to_json(), separators=(",", ":")).encode()


def _parsed(value: bytes) -> Holdings:
    """Another replica's record; one that does not parse counts as nothing, not as a refusal of
    every request (only ingress replicas may write there)."""
    try:
        return Holdings.from_json(json.loads(value))
    except ValueError:
        log.warning("a tenant record in etcd does not parse; counted as empty")
        return Holdings()
