"""Tenant limits held for the whole cluster, whatever the number of ingress replicas.

Each replica writes what it holds of each limited tenant (:class:`~services.ingress.limits.
Holdings`) to etcd under ``/laneway/tenancy/<tenant>/<replica>``, on a lease of its own, so a
replica that dies gives its requests back within the lease's TTL. To admit a request of a tenant
with a concurrency or rate limit, a replica reads the tenant's records, checks the sum with the
request added, and writes its own record in a transaction that holds only if no record of that
tenant changed since the read: two replicas cannot both take the last slot. Far below its limits
a tenant is admitted from a reserve its replica claimed beside an earlier request, with no round
trip (``services.ingress.limits.spare_slots``). Token quotas are charged after the fact (a
request's tokens are known at its end), so they are read, never claimed, and a burst may pass a
quota by what is in flight when it is reached.

etcd away (a call unanswered within ``claim_timeout_s``, or refused): each replica holds each
tenant to its share of the limits (``TenantLimits.share``) over what it holds itself, logged once;
never unlimited. A probe every ``ttl_s / 3`` seconds finds etcd back and writes what it holds.

Where there is no etcd (tests, one process), the limits hold over this replica's own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

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
from services.ingress.tenant_records import View, encoded

log = logging.getLogger(__name__)

_UNLIMITED = TenantLimits()
_RELEASE_DELAY_S = 0.02
# A tenant's reserve unused this long goes back.
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
        # The other replicas' records of each tenant as last read (by a claim or a write).
        self._others: dict[str, list[Holdings]] = {}
        # Each tenant's records as this replica's last write left them, and at which revision.
        self._views: dict[str, View] = {}
        # When each tenant's reserve was last drawn on or filled (time.monotonic()).
        self._spare_used: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._lease: aetcd.Lease | None = None
        self._leasing = asyncio.Lock()
        self._dirty: set[str] = set()
        self._flush = asyncio.Event()
        self._away = store is None
        self._replicas = 1

    def set_limits(self, limits: dict[str, TenantLimits]) -> None:
        # A tenant that loses its limits keeps only its count in flight; its record goes.
        gone = [t for t in self._limited() if not limits.get(t, _UNLIMITED).any]
        self._limits = limits
        for tenant in gone:
            self._own[tenant] = Holdings(running=self._own[tenant].running)
            self._changed(tenant)

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
        if not limits.any:
            own.running += 1  # counted, never shared nor refused
            return None
        if self._away:
            return self._enter_share(tenant, limits, prompt_tokens)
        # Far below its limits, the tenant's reserve admits it with no round trip; its token
        # quotas as last read (they are read, never claimed, either way).
        if own.take_spare(limits, self._clock()):
            self._spare_used[tenant] = time.monotonic()
            wait = self.over_quota(tenant, prompt_tokens)
            if wait is not None:
                self.leave(tenant)
            return wait
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        try:
            async with asyncio.timeout(self._claim_timeout_s):
                await lock.acquire()
        except TimeoutError:
            return 1  # this replica's own claims of the tenant queue that long: busy, not away
        try:
            return await self._claim(tenant, limits, prompt_tokens)
        except _AWAY as exc:
            self._went_away(exc)
        finally:
            lock.release()
        return self._enter_share(tenant, limits, prompt_tokens)

    def _enter_share(self, tenant: str, limits: TenantLimits, prompt_tokens: int) -> int | None:
        own, now = self._own.setdefault(tenant, Holdings()), self._clock()
        wait = refusal(limits.share(self._replicas), [own], now, prompt_tokens)
        if wait is None:
            own.admit(now)
            self._changed(tenant)
        return wait

    def over_quota(self, tenant: str, prompt_tokens: int) -> int | None:
        """For a request already admitted, once its prompt is known: None if the prompt fits the
        tenant's token quotas beside what is charged, as last read at its admission (no second
        round trip); else the whole seconds until it would."""
        limits = self._limits.get(tenant, _UNLIMITED)
        if not limits.metered:
            return None
        quotas = replace(limits, rate_per_s=None, max_concurrency=None)
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
        if not limits.any:
            own.leave()
            if own.running == 0 and tenant not in self._dirty:
                del self._own[tenant]
            return
        # Still far below its limits: the slot stays this replica's, in reserve, and nothing
        # held changes for the others to hear of.
        others = self._others.get(tenant, [])
        keep = not self._away and spare_slots(limits, [*others, own], self._replicas) > 0
        own.leave(keep_slot=keep)
        own.charge(tokens, now)
        # Written where the others count it: a slot given back, tokens charged to a quota.
        if (limits.max_concurrency is not None and not keep) or (tokens > 0 and limits.metered):
            self._changed(tenant)

    async def _claim(self, tenant: str, limits: TenantLimits, prompt_tokens: int) -> int | None:
        """Admit under the tenant's lock, or refuse; raises what a call to etcd away raises."""
        assert self._store is not None
        own = self._own.setdefault(tenant, Holdings())  # under the lock: a write may drop one
        store, key, prefix = self._store, self._key(tenant), tenant_prefix(tenant)
        tx = store.transactions
        records = tx.get(prefix, prefix_range_end(prefix))
        # The records as this replica's last write left them: one round trip, the claim's,
        # while no other replica wrote since. Taken once: stale after any change.
        view, fresh = self._views.pop(tenant, None), False
        # Claims lost to other replicas' writes are tried again (each loss reads the records
        # afresh) for half the claim's time; a request is told to retry in a second only past
        # that, and etcd is never taken for away for it.
        loop = asyncio.get_running_loop()
        contended_until = loop.time() + self._claim_timeout_s / 2
        while loop.time() < contended_until:
            if view is None:
                async with asyncio.timeout(self._claim_timeout_s):
                    found = await store.get_prefix(prefix)
                view = View.of(((kv.value, kv) for kv in found), key, found.header.revision)
                fresh = True
            self._others[tenant] = view.others
            now = self._clock()
            wait = refusal(limits, [*view.others, own], now, prompt_tokens)
            if wait is not None and not fresh:
                view = None  # refused on an old view: read it afresh first
                continue
            if wait is not None or not limits.exclusive:
                self._views[tenant] = view  # nothing written: still current
                if wait is None:  # token quotas only: written with the next flush
                    own.admit(now)
                    self._changed(tenant)
                return wait
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
            try:
                lease = await self._leased()
                async with asyncio.timeout(self._claim_timeout_s):
                    won, replies = await store.transaction(
                        compare=[
                            tx.mod(prefix, range_end=prefix_range_end(prefix)) < view.revision + 1
                        ],
                        success=[tx.put(key, encoded(claimed), lease=lease), records],
                        failure=[records],
                    )
            except BaseException:
                if carried:
                    self._dirty.add(tenant)
                raise
            # Either way the reply holds the records as they are now.
            view, fresh = View.replied(replies[-1], key), True
            if not won:
                if carried:
                    self._dirty.add(tenant)
                continue
            # ``own`` itself, not the copy: a request may have left meanwhile.
            own.admit(now)
            own.spare += slots
            own.reserve(admissions, now)
            self._spare_used[tenant] = time.monotonic()
            if view is not None:
                self._views[tenant] = view
            return None
        return 1

    def _changed(self, tenant: str) -> None:
        self._dirty.add(tenant)
        if not self._away:  # else written once the probe finds etcd back
            self._flush.set()

    def _key(self, tenant: str) -> bytes:
        return tenant_prefix(tenant) + self._replica.encode()

    async def _leased(self) -> aetcd.Lease:
        """The replica's one lease (made once, whoever asks first)."""
        assert self._store is not None
        async with self._leasing:
            if self._lease is None:
                async with asyncio.timeout(self._call_timeout_s):
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
            self._drop_idle_spares()
            try:
                if self._away or time.monotonic() - tended >= self._ttl_s / 3:
                    async with asyncio.timeout(self._call_timeout_s):
                        await self._tend()
                    tended = time.monotonic()
                await self._write_dirty()
            except _AWAY as exc:
                self._went_away(exc)
            except Exception:  # a bug, not etcd: the records must still be kept
                log.exception("keeping this replica's tenant records failed; trying again")
            else:
                if self._away:
                    self._away = False
                    log.warning("etcd reachable again: tenant limits hold across the cluster")
            spared = any(own.spare or own.rate_spare for own in self._own.values())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SPARE_IDLE_S if spared else self._ttl_s / 3):
                    await self._flush.wait()
                    # A release waits a little for the tenant's next claim (a client's next
                    # request) to carry it; held meanwhile for the others: late, never early.
                    await asyncio.sleep(_RELEASE_DELAY_S)
            self._flush.clear()

    async def _tend(self) -> None:
        """Keep the lease alive (or take a new one, writing everything held again, if it lapsed
        while etcd was away) and this replica's mark, and count the replicas."""
        assert self._store is not None
        if self._lease is not None and (await self._lease.refresh()).TTL <= 0:
            async with self._leasing:
                self._lease = None
            self._dirty.update(self._limited())
        lease = await self._leased()
        await self._store.put(REPLICAS_PREFIX + self._replica.encode(), b"{}", lease=lease)
        replicas = await self._store.get_prefix(REPLICAS_PREFIX, keys_only=True)
        self._replicas = max(1, len(list(replicas)))

    async def _write_dirty(self) -> None:
        """Write the tenants changed so far; those changed meanwhile go in the next round (a
        busy tenant cannot hold the lease's keep-alive off)."""
        batch, self._dirty = list(self._dirty), set()
        written = 0
        try:
            lease = await self._leased() if batch else None
            for tenant in batch:
                # Each its own bound: many tenants' records are no sign of etcd away.
                async with asyncio.timeout(self._call_timeout_s):
                    await self._write(tenant, lease)
                written += 1
        except BaseException:
            self._dirty.update(batch[written:])
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

    async def _write(self, tenant: str, lease: aetcd.Lease | None) -> None:
        assert self._store is not None
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            own = self._own.get(tenant)  # under the lock: a claim may have made it
            limited = self._limits.get(tenant, _UNLIMITED)
            if own is not None:
                own.prune(self._clock(), _window(limited))
            key, prefix = self._key(tenant), tenant_prefix(tenant)
            tx = self._store.transactions
            gone = own is None or own.empty
            if gone or not limited.any:
                write = tx.delete(key)
            else:
                assert own is not None
                write = tx.put(key, encoded(own), lease=lease)
            # With the records as they are after it: the next claim's view.
            _, replies = await self._store.transaction(
                compare=[], success=[write, tx.get(prefix, prefix_range_end(prefix))], failure=[]
            )
            view = View.replied(replies[-1], key)
            if gone:  # nothing held: forget the tenant here
                self._own.pop(tenant, None)
                for kept in (self._views, self._others, self._spare_used):
                    kept.pop(tenant, None)
            elif view is not None:
                self._views[tenant], self._others[tenant] = view, view.others

    async def close(self) -> None:
        """Give back what this replica holds at once, not at its lease's end."""
        if self._lease is not None and not self._away:
            with contextlib.suppress(*_AWAY):
                async with asyncio.timeout(1.0):
                    await self._lease.revoke()


def _window(limits: TenantLimits) -> float:
    return limits.rate_window_s if limits.rate_per_s is not None else MINUTE_S
