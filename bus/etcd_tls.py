"""An aetcd client that can talk to etcd over TLS, and that logs in again.

aetcd opens plaintext gRPC channels only. This client opens a TLS one instead when it is given
the CA that signed etcd's certificate (and, for an etcd that asks for one, a client certificate),
then authenticates and sets up its stubs on that channel the way aetcd does on its own.

aetcd logs in once, when it connects; etcd forgets its tokens when it restarts and after
``--auth-token-ttl`` unused, and then refuses every call with the old one. ``reconnect`` opens
a new channel (a new login where there are credentials), as a move to another member does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from bus.tls import TlsFiles


class TlsClient(aetcd.Client):  # type: ignore[misc] # aetcd has no types
    def __init__(self, *args: Any, tls: TlsFiles | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tls = tls
        self._opening = asyncio.Lock()
        self._relogin = asyncio.Lock()
        # Channels closed by ``reconnect``: gRPC cancels the calls in flight on each.
        self.reconnects = 0

    async def connect(self) -> None:
        if self.tls is None:
            await super().connect()
            return
        # Every call connects first; those that come while one connects wait for it.
        async with self._opening:
            if self._connected.is_set():
                return
            try:
                await self._open(self.tls)
            except grpc.aio.AioRpcError as exc:
                await self.channel.close()
                self._init_channel_attrs()
                # Into aetcd's errors, as its own connect raises them (failover tells by these).
                aetcd.exceptions._handle_exception(exc)

    async def reconnect(self) -> None:
        """A new channel to ``_host:_port`` (and a new token); the old one's watches end. A
        member that cannot log in now (one without a leader) leaves the client unconnected,
        for the next call to connect again, and raises."""
        channel, watcher = self.channel, self._watcher
        self.reconnects += 1
        self._init_channel_attrs()
        self._connected.clear()
        try:
            await self.connect()
        except aetcd.exceptions.ClientError:
            if self.channel is not None:  # aetcd's own connect leaves it open
                await self.channel.close()
            self._init_channel_attrs()
            raise
        finally:
            if watcher is not None:
                await watcher.shutdown()
            if channel is not None:
                await channel.close()

    async def log_in_again(self, refused: Any) -> None:
        """After a call refused its token (``refused``, the metadata it went with): one new
        login, however many calls were refused with that token."""
        async with self._relogin:
            if self.metadata is refused:
                await self.reconnect()

    async def _open(self, tls: TlsFiles) -> None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca.read_bytes(),
            private_key=tls.key.read_bytes() if tls.key is not None else None,
            certificate_chain=tls.cert.read_bytes() if tls.cert is not None else None,
        )
        self.channel = grpc.aio.secure_channel(
            f"{self._host}:{self._port}", credentials, options=list(self._options.items())
        )
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            reply = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password),
                timeout=self._timeout,
            )
            self.metadata = (("token", reply.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()
