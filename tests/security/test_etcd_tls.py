"""etcd over TLS: an embedded etcd with a certificate from a CA made by the test; the Laneway
client trusting that CA (given, or by LANEWAY_ETCD_TLS_CA) reads and writes, auth's bootstrap
runs over it, and a plaintext client gets nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest

from bus.credentials import Credentials
from bus.etcd_auth import ROOT, enable_auth
from bus.etcd_tls import TlsClient
from bus.permissions import Identity
from bus.registry import connect_etcd
from bus.tls import TlsFiles
from infra.embedded import EmbeddedServer, start_etcd
from tests.security.certificates import make_certificates

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, Path]]:
    folder = tmp_path_factory.mktemp("etcd-tls")
    ca, cert, key = make_certificates(folder)
    server = start_etcd(folder / "data", log_file=folder / "etcd.log", tls=(cert, key))
    yield server, ca
    server.stop()


async def test_the_client_over_tls_with_the_ca_given_or_set(
    tls_etcd: tuple[EmbeddedServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, ca = tls_etcd
    client = TlsClient(host="127.0.0.1", port=server.port, timeout=5, tls=TlsFiles(ca))
    try:
        await client.put(b"/laneway/test/tls", b"given")
        assert (await client.get(b"/laneway/test/tls")).value == b"given"
    finally:
        await client.close()
    monkeypatch.setenv("LANEWAY_ETCD_TLS_CA", str(ca))
    cluster = connect_etcd(f"https://127.0.0.1:{server.port}")
    try:
        assert cluster.tls == TlsFiles(ca)
        await cluster.put(b"/laneway/test/tls", b"from env")
        assert (await cluster.get(b"/laneway/test/tls")).value == b"from env"
    finally:
        await cluster.close()


async def test_a_plaintext_client_is_refused(tls_etcd: tuple[EmbeddedServer, Path]) -> None:
    server, _ = tls_etcd
    client = aetcd.Client(host="127.0.0.1", port=server.port, timeout=2)
    try:
        with pytest.raises(aetcd.exceptions.ClientError):
            await client.put(b"/laneway/test/plain", b"x")
    finally:
        await client.close()


async def test_a_client_not_trusting_the_ca_is_refused(
    tls_etcd: tuple[EmbeddedServer, Path], tmp_path: Path
) -> None:
    server, _ = tls_etcd
    other_ca = make_certificates(tmp_path)[0]
    client = TlsClient(host="127.0.0.1", port=server.port, timeout=2, tls=TlsFiles(other_ca))
    try:
        with pytest.raises(aetcd.exceptions.ClientError):
            await client.put(b"/laneway/test/untrusted", b"x")
    finally:
        await client.close()


async def test_auth_turned_on_over_tls(
    tls_etcd: tuple[EmbeddedServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Last in the module: it leaves auth on. The bootstrap finds the CA in the settings, as
    `laneway up` runs it; a worker then logs in over TLS and may write its own key only."""
    server, ca = tls_etcd
    tls = TlsFiles(ca)
    root, worker = Credentials(ROOT, "r" * 32), Credentials("worker-w1", "w" * 32)
    endpoint = f"127.0.0.1:{server.port}"
    monkeypatch.setenv("LANEWAY_ETCD_TLS_CA", str(ca))
    await enable_auth(endpoint, root, {Identity("worker", "w1"): worker})
    client = TlsClient(
        host="127.0.0.1",
        port=server.port,
        timeout=5,
        tls=tls,
        username=worker.user,
        password=worker.password,
    )
    try:
        await client.put(b"/laneway/workers/w1", b"{}")
        with pytest.raises(aetcd.exceptions.ClientError):
            await client.put(b"/laneway/workers/w2", b"{}")
    finally:
        await client.close()
