"""etcd's users and roles for Laneway, and auth turned on: each service identity a role holding
only its keys (``bus.permissions.etcd_grants``), the root user for this bootstrap alone.

Runs again on an etcd that has auth on already (a restart on the same data), as root then:
roles and users are added where missing, passwords set to those given. :func:`disable_auth`
turns it off again, for a cluster started on that data without auth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end

from bus.credentials import Credentials
from bus.etcd_tls import TlsClient
from bus.permissions import Identity, KeyGrant, etcd_grants
from bus.registry import etcd_endpoints
from bus.tls import TlsFiles

ROOT = "root"


async def enable_auth(
    endpoints: str,
    root: Credentials,
    users: dict[Identity, Credentials],
    timeout: int = 5,
    tls: TlsFiles | None = None,
    turn_on: bool = True,
) -> bool:
    """TLS from ``tls`` or else the ``LANEWAY_ETCD_TLS_*`` settings, as every service's.
    ``turn_on``: where auth is off, turn it on (else the users wait for the operator to).
    Whether auth is on now."""
    if root.user != ROOT:
        raise ValueError(f"etcd's bootstrap user is {ROOT}, not {root.user}")
    client, enabled = await _as_root(endpoints, root, timeout, tls)
    try:
        await _Bootstrap(client).run(root, users, enable=turn_on and not enabled)
    finally:
        await client.close()
    return enabled or turn_on


async def remove_users(
    endpoints: str,
    root: Credentials,
    users: list[str],
    timeout: int = 5,
    tls: TlsFiles | None = None,
) -> None:
    """Delete these users and their roles (an identity retired: a worker restarted under a new
    id), as root; those already gone are skipped. Their tokens stop working at once."""
    client, _ = await _as_root(endpoints, root, timeout, tls)
    try:
        await asyncio.gather(*(_Bootstrap(client).remove(user) for user in users))
    finally:
        await client.close()


async def disable_auth(
    endpoints: str, root: Credentials | None, timeout: int = 5, tls: TlsFiles | None = None
) -> None:
    """Auth off, as ``root`` (None: its credentials are gone); nothing to do where it is off.
    An etcd with auth on answers an anonymous call "user name is empty", which told nobody that
    its data came from a run with auth."""
    if root is None:
        client = _client(endpoints, timeout, tls)
        try:
            await client.connect()
            await client.get(b"/")
        except aetcd.exceptions.InvalidArgumentError as exc:
            raise PermissionError(
                "etcd has auth on (its data is from a run with auth) and its root's "
                "credentials are gone"
            ) from exc
        finally:
            await client.close()
        return
    client, enabled = await _as_root(endpoints, root, timeout, tls)
    try:
        if enabled:
            stub = rpc.AuthStub(client.channel)
            await stub.AuthDisable(
                rpc.AuthDisableRequest(), timeout=timeout, metadata=client.metadata
            )
    finally:
        await client.close()


def _client(
    endpoints: str, timeout: int, tls: TlsFiles | None, root: Credentials | None = None
) -> TlsClient:
    host, port = etcd_endpoints(endpoints)[0]
    login = {"username": root.user, "password": root.password} if root is not None else {}
    return TlsClient(
        host=host, port=port, timeout=timeout, tls=tls or TlsFiles.from_env("ETCD"), **login
    )


async def _as_root(
    endpoints: str, root: Credentials, timeout: int, tls: TlsFiles | None
) -> tuple[TlsClient, bool]:
    """A client logged in as root and True where auth is on; where it is not (etcd refuses the
    login there), an anonymous one and False."""
    client = _client(endpoints, timeout, tls, root)
    try:
        await client.connect()
    except aetcd.exceptions.ClientError as exc:
        await client.close()
        if "authentication is not enabled" not in str(exc):
            raise
        client = _client(endpoints, timeout, tls)
        await client.connect()
        return client, False
    return client, True


class _Bootstrap:
    def __init__(self, client: aetcd.Client) -> None:
        self._stub = rpc.AuthStub(client.channel)
        self._metadata = client.metadata
        self._timeout = client._timeout

    async def run(
        self, root: Credentials, users: dict[Identity, Credentials], enable: bool
    ) -> None:
        await self._add(self._stub.RoleAdd, rpc.AuthRoleAddRequest(name=ROOT))
        await self._user(root, ROOT)
        if any(creds.user == ROOT for creds in users.values()):
            raise ValueError("no service runs as etcd's root")
        # Each call is a raft commit of its own: the identities together share the disk's syncs.
        await asyncio.gather(*(self._identity(i, creds) for i, creds in users.items()))
        if enable:
            await self._call(self._stub.AuthEnable, rpc.AuthEnableRequest())

    async def _identity(self, identity: Identity, creds: Credentials) -> None:
        await self._add(self._stub.RoleAdd, rpc.AuthRoleAddRequest(name=creds.user))
        await asyncio.gather(
            *(
                self._call(
                    self._stub.RoleGrantPermission,
                    rpc.AuthRoleGrantPermissionRequest(name=creds.user, perm=_permission(grant)),
                )
                for grant in etcd_grants(identity)
            )
        )
        await self._user(creds, creds.user)

    async def _user(self, creds: Credentials, role: str) -> None:
        added = await self._add(
            self._stub.UserAdd, rpc.AuthUserAddRequest(name=creds.user, password=creds.password)
        )
        # Root logged in with the password it has: changing it would end this very session.
        if not added and creds.user != ROOT:
            await self._call(
                self._stub.UserChangePassword,
                rpc.AuthUserChangePasswordRequest(name=creds.user, password=creds.password),
            )
        await self._call(
            self._stub.UserGrantRole, rpc.AuthUserGrantRoleRequest(user=creds.user, role=role)
        )

    async def remove(self, user: str) -> None:
        if user == ROOT:
            raise ValueError("etcd's root is not a service's to remove")
        for call, request in (
            (self._stub.UserDelete, rpc.AuthUserDeleteRequest(name=user)),
            (self._stub.RoleDelete, rpc.AuthRoleDeleteRequest(role=user)),
        ):
            try:
                await self._call(call, request)
            except grpc.aio.AioRpcError as exc:
                if "not found" not in (exc.details() or ""):
                    raise

    async def _add(self, call: Callable[..., Awaitable[Any]], request: Any) -> bool:
        """False if it exists already."""
        try:
            await self._call(call, request)
        except grpc.aio.AioRpcError as exc:
            if "already exists" not in (exc.details() or ""):
                raise
            return False
        return True

    async def _call(self, call: Callable[..., Awaitable[Any]], request: Any) -> Any:
        return await call(request, timeout=self._timeout, metadata=self._metadata)


def _permission(grant: KeyGrant) -> Any:
    kind = rpc.Permission.READWRITE if grant.write else rpc.Permission.READ
    end = prefix_range_end(grant.key) if grant.prefix else b""
    return rpc.Permission(permType=kind, key=grant.key, range_end=end)
