"""A nats-server of a test module's own, with Laneway's users and everything the admin makes
(streams, the object store's bucket, durables), as ``laneway up`` starts it: for attacks that
may destroy or flood what they are tried on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client as NatsClient

from bus.credentials import inbox_prefix
from bus.permissions import Identity
from infra.cluster_auth import ADMIN, ClusterAuth, secure
from infra.embedded import EmbeddedServer, start_nats


@dataclass
class Provisioned:
    auth: ClusterAuth
    server: EmbeddedServer

    async def connect(self, identity: Identity) -> NatsClient:
        """A connection with ``identity``'s credentials; the server's refusals go unlogged."""

        async def quiet(_: Exception) -> None:
            return None

        return await nats.connect(
            self.auth.credentials("nats", identity.user).within(self.server.url),
            error_cb=quiet,
            allow_reconnect=False,
            inbox_prefix=inbox_prefix(identity.user),
        )

    async def admin(self) -> NatsClient:
        return await self.connect(ADMIN)


@contextmanager
def provisioned_nats(root: Path, identities: list[Identity]) -> Iterator[Provisioned]:
    auth = ClusterAuth(root / "auth", identities)
    server = start_nats(root / "nats", authorization=auth.nats_authorization())
    try:
        secure(auth, server.url, "", 1, nats=True, etcd=False)
        yield Provisioned(auth, server)
    finally:
        server.stop()
