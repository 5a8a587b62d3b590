"""NATS over TLS: an embedded server with a certificate from a CA made by the test, the Bus
trusting that CA (given, or by LANEWAY_NATS_TLS_CA), every other client refused."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from bus.client import Bus, at_server
from bus.tls import TlsFiles
from bus.topology import Subjects
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer, start_nats
from schemas.events import TokenBatch, TokensGenerated
from tests.helpers import eventually
from tests.security.certificates import make_certificates

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, Path]]:
    folder = tmp_path_factory.mktemp("nats-tls")
    ca, cert, key = make_certificates(folder)
    auth = ClusterAuth(folder / "auth", [])  # TLS beside the users, as laneway up runs it
    server = start_nats(folder / "data", authorization=auth.nats_authorization(), tls=(cert, key))
    server.url = auth.admin("nats").within(server.url)
    yield server, ca
    server.stop()


async def _round_trip(bus: Bus) -> None:
    got: list[TokenBatch | TokensGenerated] = []

    async def on_tokens(event: TokenBatch | TokensGenerated) -> None:
        got.append(event)

    topic = Subjects.tokens("tls", "w")
    await bus.subscribe(topic, on_tokens)
    await at_server(bus.nc)
    event = TokensGenerated(
        source="t", request_id="r", worker_id="w", index=0, token_ids=(1,), text="a"
    )
    await bus.publish(topic, event)
    await eventually(lambda: got == [event])


async def test_the_bus_over_tls_with_the_ca_given_or_set(
    tls_nats: tuple[EmbeddedServer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, ca = tls_nats
    bus = await Bus.connect(server.url, "tls", tls=TlsFiles(ca).client_context())
    try:
        await _round_trip(bus)
    finally:
        await bus.close()
    monkeypatch.setenv("LANEWAY_NATS_TLS_CA", str(ca))
    bus = await Bus.connect(server.url, "tls-env")
    try:
        assert bus.nc.connected_url is not None
        await _round_trip(bus)
    finally:
        await bus.close()


async def test_a_client_not_trusting_the_ca_is_refused(
    tls_nats: tuple[EmbeddedServer, Path],
) -> None:
    """nats-py upgrades to TLS when the server asks; without the CA it does not trust it."""
    server, _ = tls_nats

    async def quiet(_: Exception) -> None:
        return None

    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(server.url, allow_reconnect=False, error_cb=quiet)
