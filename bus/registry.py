"""etcd wiring (ARCHITECTURE.md §4): worker registrations under leases, and a live view of them.

aetcd is used because the ``etcd3`` package no longer imports with current protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

# Supervisors (laneway up, the tests) fork servers while a client of theirs may be live; gRPC's
# fork handlers, run in such a child before it execs, can crash it. Read when gRPC starts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd

from bus.credentials import Credentials, etcd_credentials, split_credentials
from bus.etcd_tls import TlsClient
from bus.skipped import Skipped
from bus.tls import TlsFiles
from bus.watch import watch_records as watch_records  # its readers import it from here too
from schemas.events import Role
from schemas.messages import WorkerRegistration

log = logging.getLogger(__name__)

WORKERS_PREFIX = b"/laneway/workers/"
PLANNERS_PREFIX = b"/laneway/planners/"
# The capacity plan: `roles/<worker_id>` → the role the capacity loop gave that worker.
ROLES_PREFIX = b"/laneway/roles/"
# Provisioned users a process took (``claim``): never handed out again.
CLAIMS_PREFIX = b"/laneway/claims/"
# Held by the planner replica that runs the capacity loop.
LEADER_KEY = b"/laneway/planner/leader"
# Held by the one planner replica out of the requests' intake (services.planner.intake_turn).
INTAKE_AWAY_KEY = b"/laneway/planner/intake-away"


def etcd_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """``host:port[,host:port…]`` (``http://``, ``https://`` and ``user:password@`` allowed) as
    (host, port) pairs."""
    found = []
    for endpoint in split_credentials(endpoints)[1].split(","):
        bare = endpoint.strip().removeprefix("http://").removeprefix("https://")
        host, _, port = bare.rpartition(":")
        found.append((host or "127.0.0.1", int(port)))
    return found


def connect_etcd(endpoints: str) -> EtcdCluster:
    """Credentials as ``bus.credentials.etcd_credentials`` finds them. TLS where
    ``LANEWAY_ETCD_TLS_CA`` is set (``bus.tls``)."""
    creds = etcd_credentials(endpoints)
    return EtcdCluster(etcd_endpoints(endpoints), credentials=creds, tls=TlsFiles.from_env("ETCD"))


# A member that is down, or that has no leader to forward to, answers these (or nothing).
UNREACHABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
# How long a stopping process waits for etcd to revoke its lease before leaving it to expire.
REVOKE_TIMEOUT_S = 1.0


class EtcdCluster(TlsClient):
    """An aetcd client over every member of a cluster: aetcd talks to one member, so a call that
    cannot reach it (or that it cannot serve, having lost its leader) moves the client to the next
    member and is retried there, for up to ``failover_s``.

    A move closes the old connection, which ends its watches: watchers re-read their snapshot
    and watch again from there (see ``watch_workers``). Leases live in the cluster, not in the
    connection, so keep-alives carry on from whichever member the client is on.
    """

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        timeout: int = 2,
        failover_s: float = 30.0,
        credentials: Credentials | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        # A short per-call timeout: a call stuck on a member whose leader died is retried
        # well within a lease's TTL. A move to another member authenticates again there.
        super().__init__(
            host=endpoints[0][0],
            port=endpoints[0][1],
            timeout=timeout,
            username=credentials.user if credentials else None,
            password=credentials.password if credentials else None,
            tls=tls,
        )
        self.endpoints = endpoints
        self.at = 0
        self._failover_s = failover_s
        self._moving = asyncio.Lock()
        self._warned_at = -60.0  # loop time starts near 0 on a fresh machine

    async def move_on(self, failed_at: int) -> None:
        """Leave member ``failed_at`` for the next one (unless another call already moved)."""
        async with self._moving:
            if self.at != failed_at:
                return
            self.at = (failed_at + 1) % len(self.endpoints)
            self._host, self._port = self.endpoints[self.at]
            now = asyncio.get_running_loop().time()
            if self.at != failed_at or now - self._warned_at >= 5.0:  # a lone one: now and then
                self._warned_at = now
                moved = (*self.endpoints[failed_at], self._host, self._port)
                log.warning("etcd member %s:%s unreachable; moving to %s:%s", *moved)
            with contextlib.suppress(*UNREACHABLE):  # no leader there yet to log in with
                await self.reconnect()


def _failing_over(call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(call)
    async def retried(self: EtcdCluster, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._failover_s
        tried = 0
        while True:
            at, token, reconnects = self.at, self.metadata, self.reconnects
            try:
                return await call(self, *args, **kwargs)
            except asyncio.CancelledError:
                # Another call's reconnect closed the channel this call was on, and gRPC
                # cancels what is in flight there; that is no cancel of this task (which goes up).
                task = asyncio.current_task()
                if self.reconnects == reconnects or (task is not None and task.cancelling()):
                    raise
                if loop.time() > deadline:
                    raise aetcd.exceptions.ConnectionFailedError("cut off by reconnects") from None
            except aetcd.exceptions.UnauthenticatedError as exc:
                # A token etcd forgot (restarted) or let lapse: log in again, once per token.
                if "invalid auth token" not in str(exc) or loop.time() > deadline:
                    raise
                log.warning("etcd refused this client's token; logging in again")
                with contextlib.suppress(*UNREACHABLE):  # the next try moves on, then
                    await self.log_in_again(token)
            except aetcd.exceptions.ClientError as exc:
                # A call cut off by another call's move is retried on the new member too.
                if not isinstance(exc, UNREACHABLE) and self.at == at:
                    raise
                if loop.time() > deadline:
                    raise
                tried += 1
                await self.move_on(at)
                if tried % len(self.endpoints) == 0:  # every member refused: wait for one
                    await asyncio.sleep(0.2)

    return retried


for _name in (
    "get",
    "get_prefix",
    "put",
    "delete",
    "delete_prefix",
    "transaction",
    "lease",
    "revoke_lease",
    "refresh_lease",
    "get_lease_info",
    "watch",
    "watch_prefix",
):
    setattr(EtcdCluster, _name, _failing_over(getattr(aetcd.Client, _name)))


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
    def intake_away(cls, client: aetcd.Client, instance_id: str, ttl_s: int) -> LeasedKey:
        return cls(client, INTAKE_AWAY_KEY, instance_id.encode(), ttl_s, renew=False)

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
        return False

    async def update(self, value: bytes) -> None:
        """A new value under the same lease (a worker's registration after a role change)."""
        self._value = value
        if self._lease is None:
            return
        try:
            await self._client.put(self.key, value, lease=self._lease)
        except aetcd.exceptions.ClientError as exc:
            # Expired while etcd was out of reach longer than the TTL: registered again.
            if not self._renew or "lease not found" not in str(exc):
                raise
            await self._register_again()

    async def _register_again(self) -> None:
        log.warning("lease of %s expired; registering again", self.key.decode())
        self._lease = await self._client.lease(self._ttl_s)
        await self._client.put(self.key, self._value, lease=self._lease)

    async def _keep_alive(self) -> None:
        assert self._lease is not None
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                reply = await self._lease.refresh()
                if reply.TTL <= 0 and self._renew:
                    await self._register_again()
            except Exception:  # a missed refresh is retried; the TTL leaves room for two more
                log.warning("lease refresh failed", exc_info=True)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease is not None:
            # Leaving at once is a courtesy: with etcd gone too (the whole cluster stopping),
            # failing over for it would hold the process past its shutdown, and the lease
            # expires by itself after its TTL anyway.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), REVOKE_TIMEOUT_S)
        self._task = self._lease = None


WorkersChanged = Callable[[dict[str, WorkerRegistration]], Awaitable[None]]


async def watch_workers(client: aetcd.Client, on_change: WorkersChanged) -> None:
    """Call ``on_change`` with the full live worker set now and after every change, forever.
    A value that is not a worker's registration, or a key without a lease, is left out."""

    async def changed(workers: dict[bytes, WorkerRegistration]) -> None:
        await on_change({reg.worker_id: reg for reg in workers.values()})

    # A registration without a lease would stand for good, its worker dead or not.
    await watch_records(
        client, WORKERS_PREFIX, "worker registration", _registration, changed, leased=True
    )


def _registration(key: bytes, value: bytes) -> WorkerRegistration:
    reg = WorkerRegistration.model_validate_json(value)
    if key != WORKERS_PREFIX + reg.worker_id.encode():
        raise ValueError(f"the registration of {reg.worker_id!r} is under another key")
    return reg


def role_key(worker_id: str) -> bytes:
    return ROLES_PREFIX + worker_id.encode()


def claim_key(user: str) -> bytes:
    return CLAIMS_PREFIX + user.encode()


async def claim(client: aetcd.Client, user: str, by: str) -> bool:
    """Take the provisioned ``user`` for good, for the process ``by`` names (host, pid): True
    where no process took it before. A worker id is used once (the kv-indexer folds a worker's
    events in their numbers' order from 1), and an ingress's or kv-indexer's id must not be two
    processes' at once, so processes handed users from a shared folder (``infra.provisioned``),
    on any host, claim one first."""
    key = claim_key(user)
    tx = client.transactions
    won, _ = await client.transaction(
        compare=[tx.create(key) == 0], success=[tx.put(key, by.encode())], failure=[]
    )
    return bool(won)


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
    skipped = Skipped("role")
    while True:
        try:
            snapshot = await client.get_prefix(key)
            for kv in snapshot:
                if kv.key == key and (role := skipped.parse(key, kv.value, _role)) is not None:
                    await on_change(role)
            start = snapshot.header.revision + 1
            async for event in await client.watch(key, start_revision=start):
                if event.kind != aetcd.EventKind.PUT:
                    continue
                if (role := skipped.parse(key, event.kv.value, _role)) is not None:
                    await on_change(role)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("role watch broke; re-reading from etcd", exc_info=True)
            await asyncio.sleep(1.0)


def _role(key: bytes, value: bytes) -> Role:
    role = value.decode()
    if role not in ("prefill", "decode", "both"):
        raise ValueError(f"unknown role {role!r}")
    return role  # type: ignore[return-value]
