"""`laneway up --bus-tls-dir`: the embedded NATS and etcd serve TLS and take only clients with a
certificate from the folder's CA; the services connect so (a request is answered), while a
plaintext client, and a TLS client without a client certificate, are refused, each with the
admin's password (so the certificate is what is missing)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import aetcd
import httpx
import nats
import nats.errors
import pytest

from bus.credentials import Credentials
from bus.etcd_tls import TlsClient
from bus.tls import TlsFiles
from infra.ports import free_port
from tests.infra.laneway_up import api_headers, launch, wait_serving
from tests.security.certificates import make_certificates

pytestmark = pytest.mark.live  # starts `laneway up`, its servers and services


class Up:
    def __init__(self, state: Path, certs: Path, http: int, nats_port: int, etcd: int) -> None:
        self.state, self.certs = state, certs
        self.http, self.nats_port, self.etcd_port = http, nats_port, etcd

    def admin(self, server: str) -> Credentials:
        return Credentials.read(self.state / "auth" / server / "admin.json")

    @property
    def client(self) -> TlsFiles:
        return TlsFiles(
            self.certs / "ca.pem", self.certs / "client.pem", self.certs / "client-key.pem"
        )


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    certs, state = tmp_path_factory.mktemp("certs"), tmp_path_factory.mktemp("state")
    make_certificates(certs, client=True)
    found = Up(state, certs, free_port(), free_port(), free_port())
    proc = launch(
        found.http,
        state,
        *("--workers", "1", "--bus-tls-dir", str(certs)),
        *("--nats-port", str(found.nats_port), "--etcd-port", str(found.etcd_port)),
    )
    try:
        wait_serving(proc, timeout=60)
        yield found
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


async def _quiet(_: Exception) -> None:
    return None


def test_the_services_talk_over_tls_with_their_certificate(up: Up) -> None:
    reply = httpx.post(
        f"http://127.0.0.1:{up.http}/v1/completions",
        json={"model": "laneway-sim", "prompt": "Once", "max_tokens": 2},
        headers=api_headers(up.state),
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


async def test_nats_takes_only_tls_clients_with_a_certificate(up: Up) -> None:
    url = up.admin("nats").within(f"nats://127.0.0.1:{up.nats_port}")
    with pytest.raises((nats.errors.Error, OSError)):
        # Plaintext: nats-py upgrades when the server asks, and trusts no unknown CA.
        await nats.connect(url, allow_reconnect=False, error_cb=_quiet, connect_timeout=3)
    no_cert = TlsFiles(up.client.ca).client_context()
    with pytest.raises((nats.errors.Error, OSError)):
        await nats.connect(
            url, allow_reconnect=False, error_cb=_quiet, tls=no_cert, connect_timeout=3
        )
    nc = await nats.connect(url, allow_reconnect=False, tls=up.client.client_context())
    await nc.close()


async def test_etcd_takes_only_tls_clients_with_a_certificate(up: Up) -> None:
    admin = up.admin("etcd")
    login = {"host": "127.0.0.1", "port": up.etcd_port, "timeout": 3}
    login |= {"username": admin.user, "password": admin.password}
    for refused in (aetcd.Client(**login), TlsClient(**login, tls=TlsFiles(up.client.ca))):
        try:
            with pytest.raises(aetcd.exceptions.ClientError):
                await refused.put(b"/laneway/test/tls-up", b"x")
        finally:
            await refused.close()
    allowed = TlsClient(**login, tls=up.client)
    try:
        await allowed.put(b"/laneway/test/tls-up", b"with a certificate")
        assert (await allowed.get(b"/laneway/test/tls-up")).value == b"with a certificate"
    finally:
        await allowed.close()
