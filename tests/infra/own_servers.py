"""A NATS and an etcd as an operator runs them, with auth of their own (issue 38): nats-server
with a users list (a password user and an nkey user: nothing anonymous) and etcd with auth on
as its root, whose credentials are in LANEWAY_ETCD_USER/LANEWAY_ETCD_PASSWORD; and what the
operator does with `laneway bus provision`'s accounts file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import nkeys
import pytest

from bus.credentials import Credentials, split_credentials
from bus.etcd_auth import enable_auth
from infra.embedded import EmbeddedServer, start_etcd, start_nats
from infra.ports import free_port
from infra.provisioned import NATS_ACCOUNTS_FILE

# Every character a URL's user part must escape, so that the URL's reading is tested too.
OP_PASSWORD = "p@ss:w/rd,%x"
ROOT_PASSWORD = "root-pw"


@dataclass
class OwnServers:
    nats: EmbeddedServer
    etcd: EmbeddedServer
    monitor: int
    nkey_public: str

    @property
    def nats_plain(self) -> str:
        return self.nats.url

    @property
    def etcd_plain(self) -> str:
        return split_credentials(self.etcd.url)[1]

    @property
    def conf(self) -> Path:
        return Path(self.nats.args[self.nats.args.index("-c") + 1])


def user_seed() -> bytes:
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


@pytest.fixture
def own_servers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OwnServers]:
    """nats-server (JetStream) whose users are an operator's (a password user and an nkey user:
    nothing anonymous), and etcd with auth on as its root; the root's credentials in
    LANEWAY_ETCD_USER/LANEWAY_ETCD_PASSWORD, as an operator sets them (services inherit them)."""
    seed = user_seed()
    (tmp_path / "user.nk").write_bytes(seed)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    monitor = free_port()
    users = (
        f'http: "127.0.0.1:{monitor}"\n'
        f"authorization {{ users: [ {{user: op, password: {json.dumps(OP_PASSWORD)}}}, "
        f"{{nkey: {public}}} ] }}\n"
    )
    nats_server = start_nats(tmp_path / "nats", authorization=users)
    etcd = start_etcd(tmp_path / "etcd")
    try:
        asyncio.run(enable_auth(etcd.url, Credentials("root", ROOT_PASSWORD), {}))
        monkeypatch.setenv("LANEWAY_ETCD_USER", "root")
        monkeypatch.setenv("LANEWAY_ETCD_PASSWORD", ROOT_PASSWORD)
        yield OwnServers(nats_server, etcd, monitor, public)
    finally:
        nats_server.stop()
        etcd.stop()


def include_and_reload(servers: OwnServers, folder: Path) -> None:
    """What the operator does with the accounts file: includes it (a path from the
    configuration's folder) and reloads nats-server; returns once its admin logs in."""
    accounts = os.path.relpath(folder / NATS_ACCOUNTS_FILE, servers.conf.parent)
    conf = servers.conf.read_text()
    if accounts not in conf:
        servers.conf.write_text(conf + f'include "{accounts}"\n')
    servers.nats.proc.send_signal(signal.SIGHUP)
    admin = Credentials.read(folder / "nats" / "admin.json").within(servers.nats_plain)
    deadline = time.monotonic() + 10
    while asyncio.run(refused(admin)):
        assert time.monotonic() < deadline, "nats-server did not take the provisioned users"
        time.sleep(0.1)


def nats_users(monitor: int) -> list[str]:
    """The user of each client connection nats-server holds now."""
    reply = httpx.get(f"http://127.0.0.1:{monitor}/connz?auth=true&limit=1024", timeout=5)
    return [c.get("authorized_user", "") for c in reply.json()["connections"]]


async def refused(url: str) -> bool:
    """Whether nats-server refuses a connection with what ``url`` carries."""

    async def quiet(_: Exception) -> None:
        return None

    try:
        nc = await nats.connect(url, allow_reconnect=False, error_cb=quiet, connect_timeout=2)
    except Exception:
        return True
    await nc.close()
    return False
