"""An etcd that answers but refuses the user asking (none given, or a wrong password) is one line
from `laneway keys` and a DOWN row in `laneway status`, not a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.credentials import split_credentials
from bus.permissions import Identity
from infra.cli import main
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer
from tests.live import admin_etcd

pytestmark = pytest.mark.live  # a real etcd with auth on


@pytest.fixture
def refusing_etcd(tmp_path: Path) -> Iterator[str]:
    """The endpoint of an etcd with auth on, without credentials."""
    server: EmbeddedServer = admin_etcd(
        ClusterAuth(tmp_path / "auth", [Identity("planner")]), tmp_path / "etcd"
    )
    try:
        yield split_credentials(server.url)[1]
    finally:
        server.stop()


@pytest.mark.parametrize("user", ["", "admin:wrong@"])
def test_keys_says_in_one_line_that_etcd_refused(
    refusing_etcd: str, user: str, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = user + refusing_etcd.removeprefix("http://")
    with pytest.raises(SystemExit) as exited:
        main(["keys", "list", "--etcd-endpoints", endpoint])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "refused or did not answer" in lines[0], lines
    assert "wrong" not in lines[0]  # no password on the screen


def test_status_shows_an_etcd_that_refuses_its_user_as_down(
    refusing_etcd: str, nats_server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["status", "--nats-url", nats_server.url, "--etcd-endpoints", refusing_etcd])
    out = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in out.err and "user name is empty" in out.out, out
