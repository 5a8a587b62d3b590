"""etcd wiring (ARCHITECTURE.md §4): worker registrations under leases, and a live view of them.

aetcd is used because the ``etcd3`` package no longer imports with current protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable

import aetcd

from schemas.events import Role
from schemas.messages import WorkerRegistration

log = logging.getLogger(__name__)

WORKERS_PREFIX = b"/laneway/workers/"
PLANNERS_PREFIX = b"/laneway/planners/"
# The capacity plan: `roles/<worker_id>` → the role the capacity loop gave that worker.
ROLES_PREFIX = b"/laneway/roles/"
# Held by the planner replica that runs the capacity loop.
LEADER_KEY = b"/laneway/planner/leader"


def connect_etcd(endpoints: str) -> aetcd.Client:
    """``endpoints`` is ``host:port[,host:port…]``; aetcd talks to one member, the first."""
    host, _, port = endpoints.split(",")[0].strip().removeprefix("http://").rpartition(":")
    return aetcd.Client(host=host or "127.0.0.1", port=int(port), timeout=5)


class LeasedKey:
    """Keeps a key alive under a lease; when the process dies the key expires with it."""

    def __init__(
        self, client: aetcd.Client, key: bytes, value: bytes, ttl_s: int, renew: bool = True
    ) -> None:
        self._client = client
        self.key = key
        self._value = value
        self._ttl_s = ttl_s
        # Put the key back under a new lease if the old one expired (a paused process coming
        # back); never for an election, whose key may have a new holder by then.
        self._renew = renew
        self._lease: aetcd.Lease | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def worker(
        cls, client: aetcd.Client, registration: WorkerRegistration, ttl_s: int
    ) -> LeasedKey:
        key = WORKERS_PREFIX + registration.worker_id.encode()
        return cls(client, key, registration.model_dump_json().encode(), ttl_s)

    @classmethod
    def leader(cls, client: aetcd.Client, instance_id: str, ttl_s: int) -> LeasedKey:
        return cls(client, LEADER_KEY, instance_id.encode(), ttl_s, renew=False)

    @classmethod
    def planner(cls, client: aetcd.Client, instance_id: str, ttl_s: int) -> LeasedKey:
        """A planner replica that is consuming requests (operators, readiness checks)."""
        return cls(client, PLANNERS_PREFIX + instance_id.encode(), str(os.getpid()).encode(), ttl_s)

    async def start(self) -> None:
        self._lease = await self._client.lease(self._ttl_s)
        await self._client.put(self.key, self._value, lease=self._lease)
        self._task = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    async def start_if_absent(self) -> bool:
        """Take the key unless someone holds it (an election); True if this holder has it now."""
        if self._task is not None:
            return await self.holds()
        lease = await self._client.lease(self._ttl_s)
        tx = self._client.transactions
        won, _ = await self._client.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self._value, lease=lease)],
            failure=[],
        )
        if not won:
            await lease.revoke()
            return False
        self._lease = lease
        self._task = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")
        return True

    async def holds(self) -> bool:
        """Whether the key still carries this holder's value (its lease may have lapsed)."""
        found = await self._client.get(self.key)
        if found is not None and found.value == self._value:
            return True
        await self.stop()  # lost it: campaign afresh next time
        self._task = self._lease = None
        return False

    async def update(self, value: bytes) -> None:
        """A new value under the same lease (a worker's registration after a role change)."""
        self._value = value
        if self._lease is not None:
            await self._client.put(self.key, value, lease=self._lease)

    async def _keep_alive(self) -> None:
        assert self._lease is not None
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                reply = await self._lease.refresh()
                if reply.TTL <= 0 and self._renew:
                    log.warning("lease of %s expired; registering again", self.key.decode())
                    self._lease = await self._client.lease(self._ttl_s)
                    await self._client.put(self.key, self._value, lease=self._lease)
            except Exception:  # a missed refresh is retried; the TTL leaves room for two more
                log.warning("lease refresh failed", exc_info=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()


WorkersChanged = Callable[[dict[str, WorkerRegistration]], Awaitable[None]]


async def watch_workers(client: aetcd.Client, on_change: WorkersChanged) -> None:
    """Call ``on_change`` with the full live worker set now and after every change, forever.

    A broken watch (etcd restarting, a network blip) is re-established from a fresh snapshot,
    so no change is missed for good.
    """
    while True:
        try:
            await _watch_once(client, on_change)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("worker watch broke; re-reading from etcd", exc_info=True)
            await asyncio.sleep(1.0)


async def _watch_once(client: aetcd.Client, on_change: WorkersChanged) -> None:
    workers: dict[str, WorkerRegistration] = {}
    snapshot = await client.get_prefix(WORKERS_PREFIX)
    for kv in snapshot:
        reg = WorkerRegistration.model_validate_json(kv.value)
        workers[reg.worker_id] = reg
    await on_change(dict(workers))
    watch = await client.watch_prefix(WORKERS_PREFIX, start_revision=snapshot.header.revision + 1)
    async for event in watch:
        worker_id = event.kv.key[len(WORKERS_PREFIX) :].decode()
        if event.kind == aetcd.EventKind.PUT:
            workers[worker_id] = WorkerRegistration.model_validate_json(event.kv.value)
        else:
            workers.pop(worker_id, None)
        await on_change(dict(workers))


SESSIONS_PREFIX = b"/laneway/sessions/"


class SessionStore:
    """`sessions/<id>` → the worker that owns that conversation's cache, shared by every planner
    replica. A binding lives ``ttl_s`` after it was last set; an idle conversation's cache is
    likely evicted by then anyway."""

    def __init__(self, client: aetcd.Client, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s

    @staticmethod
    def key(session_id: str) -> bytes:
        return SESSIONS_PREFIX + session_id.encode()

    async def owner(self, session_id: str) -> str | None:
        found = await self._client.get(self.key(session_id))
        return found.value.decode() if found is not None else None

    async def claim(self, session_id: str, worker_id: str) -> str:
        """Bind the session to ``worker_id`` unless a replica bound it first; returns the owner."""
        key = self.key(session_id)
        tx = self._client.transactions
        lease = await self._client.lease(self._ttl_s)
        won, responses = await self._client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, worker_id.encode(), lease=lease)],
            failure=[tx.get(key)],
        )
        if won:
            return worker_id
        await lease.revoke()
        ranges = responses[0] if responses else []
        return ranges[0][0].decode() if ranges else worker_id

    async def move(self, session_id: str, worker_id: str) -> None:
        lease = await self._client.lease(self._ttl_s)
        await self._client.put(self.key(session_id), worker_id.encode(), lease=lease)


def role_key(worker_id: str) -> bytes:
    return ROLES_PREFIX + worker_id.encode()


async def assign_roles(client: aetcd.Client, roles: dict[str, Role]) -> None:
    """Write a capacity step's new roles at once: workers see all of them or none."""
    tx = client.transactions
    await client.transaction(
        compare=[],
        success=[tx.put(role_key(w), role.encode()) for w, role in roles.items()],
        failure=[],
    )


RoleChanged = Callable[[Role], Awaitable[None]]


async def watch_role(client: aetcd.Client, worker_id: str, on_change: RoleChanged) -> None:
    """Call ``on_change`` with the role assigned to ``worker_id`` now (if any) and after every
    change, forever; a broken watch is re-established from a fresh read."""
    key = role_key(worker_id)
    while True:
        try:
            snapshot = await client.get_prefix(key)
            for kv in snapshot:
                if kv.key == key:
                    await on_change(_role(kv.value))
            start = snapshot.header.revision + 1
            async for event in await client.watch(key, start_revision=start):
                if event.kind == aetcd.EventKind.PUT:
                    await on_change(_role(event.kv.value))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("role watch broke; re-reading from etcd", exc_info=True)
            await asyncio.sleep(1.0)


def _role(value: bytes) -> Role:
    role = value.decode()
    if role not in ("prefill", "decode", "both"):
        raise ValueError(f"unknown role {role!r}")
    return role  # type: ignore[return-value]
