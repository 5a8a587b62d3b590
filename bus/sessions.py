"""Session ownership in etcd: which worker holds each conversation's cache, shared by every
planner replica.

etcd away must not stop routing: a session's owner only helps its cache hit. Each call to etcd
is bounded; one that fails to reach it puts the store in degraded mode, logged once: for a few
seconds no call goes to etcd, owners come from a cache that a watch keeps (and this replica's
own claims), and claims are taken locally. The next call after that probes etcd again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import aetcd
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bus.registry import UNREACHABLE
from bus.skipped import Skipped

SESSIONS_PREFIX = b"/laneway/sessions/"

log = logging.getLogger(__name__)
T = TypeVar("T")


def session_key(tenant: str | None, session_id: str) -> str:
    """Whose conversation a client's session id names: its tenant's (``tenant/id``), so that two
    tenants sending the same id never share its owner or what is learnt of it; the id as given
    where the API takes no keys. A tenant's name has no '/', so tenants' keys never meet."""
    return session_id if tenant is None else f"{tenant}/{session_id}"


class SessionRefused(Exception):
    """etcd will not store or read a session's binding, and asking again will not change that
    (a key past its request limit, its space quota reached): the request must not be retried."""


@contextlib.contextmanager
def _refusals(session_id: str) -> Iterator[None]:
    try:
        yield
    except UNREACHABLE:
        raise  # etcd away for now: the caller answers from its cache
    except aetcd.exceptions.ClientError as exc:
        raise SessionRefused(
            f"etcd refused the binding of session {session_id[:64]!r}: {exc}"
        ) from exc


class SessionStore:
    """`sessions/<id>` → the worker that owns that conversation's cache, shared by every planner
    replica. A binding lives ``ttl_s`` after it was last set; an idle conversation's cache is
    likely evicted by then anyway. A binding that is no worker id is taken as no binding.

    ``call_timeout_s`` bounds each call to etcd (its client would otherwise retry for half a
    minute); ``probe_after_s`` is how long degraded mode skips etcd before trying it again."""

    def __init__(
        self,
        client: aetcd.Client,
        ttl_s: int,
        call_timeout_s: float = 1.0,
        probe_after_s: float = 2.0,
        max_cached: int = 100_000,
    ) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._skipped = Skipped("session binding")
        self._call_timeout_s = call_timeout_s
        self._probe_after_s = probe_after_s
        self._max_cached = max_cached
        self._cached: dict[str, str] = {}
        # The watch has read every binding and follows etcd's changes (owners come from it).
        self._synced = False
        self._skip_until: float | None = None  # degraded while set
        self.metrics = _Metrics(self)
        self.degraded_calls = 0

    @property
    def degraded(self) -> bool:
        return self._skip_until is not None

    @staticmethod
    def key(session_id: str) -> bytes:
        return SESSIONS_PREFIX + session_id.encode()

    async def owner(self, session_id: str) -> str | None:
        """From the watched cache while the watch is in step with etcd (no round trip per
        request); a binding another replica made a moment ago and not yet seen here is then
        found by the claim, which etcd decides."""
        if self._synced and self._skip_until is None:
            return self._cached.get(session_id)
        key = self.key(session_id)
        with _refusals(session_id):
            found = await self._call(self._client.get(key))
        if isinstance(found, _Away):
            return self._cached.get(session_id)
        return self._owner(key, found.value) if found is not None else None

    async def claim(self, session_id: str, worker_id: str) -> str:
        """Bind the session to ``worker_id`` unless a replica bound it first; returns the owner.
        With etcd away, the binding is this replica's alone until etcd answers again."""
        won = await self._call(self._claim(session_id, worker_id))
        owner = worker_id if isinstance(won, _Away) else won
        self._remember(session_id, owner)
        return owner

    async def move(self, session_id: str, worker_id: str) -> None:
        async def put() -> None:
            lease = await self._client.lease(self._ttl_s)
            await self._client.put(self.key(session_id), worker_id.encode(), lease=lease)

        with _refusals(session_id):
            await self._call(put())
        self._remember(session_id, worker_id)

    async def watch(self) -> None:
        """Keep the cache of owners that degraded mode answers from, forever; a broken watch
        (etcd away) is set up again from a fresh read once etcd answers."""
        while True:
            try:
                await self._watch_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever broke it, the cache stands meanwhile
                log.debug("session watch broke (%s); again in 1 s", exc)
                await asyncio.sleep(1.0)
            finally:
                self._synced = False

    async def _watch_once(self) -> None:
        # Change by change, not registry.watch_records' whole set on each: sessions are many.
        snapshot = await self._client.get_prefix(SESSIONS_PREFIX)
        for kv in snapshot:
            self._put(kv.key, kv.value)
        start = snapshot.header.revision + 1
        changes = await self._client.watch_prefix(SESSIONS_PREFIX, start_revision=start)
        self._synced = True
        async for event in changes:
            if event.kind == aetcd.EventKind.PUT:
                self._put(event.kv.key, event.kv.value)
            else:
                self._skipped.forget(event.kv.key)
                self._cached.pop(event.kv.key.removeprefix(SESSIONS_PREFIX).decode(), None)

    def _put(self, key: bytes, value: bytes) -> None:
        owner = self._owner(key, value)
        with contextlib.suppress(UnicodeDecodeError):
            session_id = key.removeprefix(SESSIONS_PREFIX).decode()
            if owner is None:
                self._cached.pop(session_id, None)
            else:
                self._remember(session_id, owner)

    def _remember(self, session_id: str, owner: str) -> None:
        self._cached.pop(session_id, None)  # to the end: the oldest go first past the bound
        self._cached[session_id] = owner
        while len(self._cached) > self._max_cached:
            del self._cached[next(iter(self._cached))]

    async def _claim(self, session_id: str, worker_id: str) -> str:
        key = self.key(session_id)
        tx = self._client.transactions
        with _refusals(session_id):
            lease = await self._client.lease(self._ttl_s)
            try:
                won, responses = await self._client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, worker_id.encode(), lease=lease)],
                    failure=[tx.get(key)],
                )
            except aetcd.exceptions.ClientError:
                with contextlib.suppress(aetcd.exceptions.ClientError):
                    await lease.revoke()
                raise
            if won:
                return worker_id
            await lease.revoke()
        ranges = responses[0] if responses else []
        return (self._owner(key, ranges[0][0]) if ranges else None) or worker_id

    async def _call(self, call: Awaitable[T]) -> T | _Away:
        """``call``'s answer, or ``_AWAY`` when etcd does not give one in time (degraded mode
        entered) or degraded mode skips etcd for now."""
        if self._skip_until is not None and time.monotonic() < self._skip_until:
            if asyncio.iscoroutine(call):
                call.close()  # never awaited: no warning about it
            self.degraded_calls += 1
            return _AWAY
        try:
            answer = await asyncio.wait_for(call, self._call_timeout_s)
        except (TimeoutError, *UNREACHABLE) as exc:
            if self._skip_until is None:
                log.warning(
                    "etcd unreachable (%s): routing without session ownership, from cached "
                    "owners, until it answers",
                    type(exc).__name__,
                )
            self._skip_until = time.monotonic() + self._probe_after_s
            self.degraded_calls += 1
            return _AWAY
        if self._skip_until is not None:
            log.warning("etcd answers again: session ownership restored")
            self._skip_until = None
        return answer

    def _owner(self, key: bytes, value: bytes) -> str | None:
        return self._skipped.parse(key, value, _worker_id)


class _Away:
    """etcd did not answer (see ``SessionStore._call``)."""


_AWAY = _Away()


class _Metrics(Collector):
    def __init__(self, store: SessionStore) -> None:
        self._store = store

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "laneway_planner_sessions_degraded",
            "1 while etcd is unreachable and sessions are routed from cached owners.",
            value=int(self._store.degraded),
        )
        yield CounterMetricFamily(
            "laneway_planner_sessions_degraded_calls",
            "Session lookups, claims and moves answered without etcd (it was unreachable).",
            value=self._store.degraded_calls,
        )


def _worker_id(key: bytes, value: bytes) -> str:
    return value.decode()
