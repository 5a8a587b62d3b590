"""`laneway up` on a NATS and an etcd the operator runs with auth of their own (issue 38): with
the credentials given (a user in the URL, etcd's root from LANEWAY_ETCD_USER/PASSWORD), and
after `laneway bus provision`, each service as a user of its own. The servers are real and
started here as an operator would run them: nats-server with a users list, etcd with auth on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from bus.client import Bus
from bus.credentials import NATS_CREDS_ENV, NATS_NKEY_ENV, Credentials, split_credentials
from bus.permissions import etcd_grants
from bus.registry import connect_etcd
from infra.bus_provision import claimed
from infra.cli import main
from infra.cluster import LocalCluster
from infra.provisioned import NATS_ACCOUNTS_FILE, Provisioned, identity_of_user
from infra.startup import StartupError
from tests.infra.own_servers import (
    OP_PASSWORD,
    OwnServers,
    include_and_reload,
    nats_users,
    refused,
    user_seed,
)
from tests.live import ClusterFactory

pytestmark = pytest.mark.live  # real nats-server and etcd, and a cluster on them


def _complete(cluster: LocalCluster) -> None:
    reply = httpx.post(
        cluster.config.base_url + "/completions",
        json={"model": "laneway-sim", "prompt": "Once upon", "max_tokens": 4},
        headers=cluster.api_headers,
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_up_serves_with_the_credentials_given(
    own_servers: OwnServers, cluster_factory: ClusterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    assert asyncio.run(refused(own_servers.nats_plain))  # the server takes no stranger
    user_url = own_servers.nats_plain.replace("://", f"://op:{quote(OP_PASSWORD, safe='')}@")
    cluster = cluster_factory(workers=1, nats_url=user_url, etcd_endpoints=own_servers.etcd_plain)
    try:
        _complete(cluster)
        for service in cluster.services:  # no files of users the servers do not know
            assert NATS_CREDS_ENV not in service.env, service.name
        state = str(cluster.config.state_dir)
        assert main(["status", "--state-dir", state]) == 0
        assert "healthy" in capsys.readouterr().out
        assert main(["keys", "list", "--state-dir", state]) == 0
    finally:
        cluster.stop()


def test_an_nkey_seed_file_logs_in(own_servers: OwnServers, tmp_path: Path) -> None:
    async def login(seed_file: Path) -> bool:
        os.environ[NATS_NKEY_ENV] = str(seed_file)
        try:
            bus = await asyncio.wait_for(Bus.connect(own_servers.nats_plain, "nkey-test"), 5)
        except Exception:
            return False
        finally:
            del os.environ[NATS_NKEY_ENV]
        await bus.close()
        return True

    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(user_seed())
    assert asyncio.run(login(tmp_path / "user.nk"))
    assert not asyncio.run(login(stranger))


async def _etcd_login(creds: Credentials, endpoints: str) -> bool:
    """Whether etcd lets ``creds`` read a key its role may read."""
    identity = identity_of_user(creds.user)
    assert identity is not None
    client = connect_etcd(creds.within(endpoints))
    try:
        await client.get(etcd_grants(identity)[0].key)
    except Exception:
        return False
    finally:
        await client.close()
    return True


def test_after_provision_each_service_runs_as_its_own_user(
    own_servers: OwnServers, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "provisioned"
    args = ["bus", "provision", "--out", str(folder), "--etcd-endpoints", own_servers.etcd_plain]
    assert main([*args, "--workers", "3"]) == 0
    include_and_reload(own_servers, folder)
    cluster = cluster_factory(
        workers=2,
        nats_url=own_servers.nats_plain,
        etcd_endpoints=own_servers.etcd_plain,
        bus_credentials=folder,
    )
    try:
        _complete(cluster)
        identities = set(os.listdir(folder / "nats"))
        services = set()
        for service in cluster.services:
            services.add(Path(service.env[NATS_CREDS_ENV]).name)
            assert Path(service.env["LANEWAY_ETCD_CREDS_FILE"]).parent == folder / "etcd"
            assert split_credentials(service.env["LANEWAY_NATS_URL"])[0] is None
        assert services <= identities and len(services) == 5  # 2 workers, and one of each
        connected = set(nats_users(own_servers.monitor))
        assert connected == {name.removesuffix(".json") for name in services}, connected
        workers = {
            f"worker-{s.env['LANEWAY_WORKER_ID']}"
            for s in cluster.services
            if "LANEWAY_WORKER_ID" in s.env
        }
        spent = asyncio.run(claimed(own_servers.etcd_plain))
        assert spent == workers
    finally:
        cluster.stop()
    # Three workers wanted, one user left that no process took: refused in one line.
    with pytest.raises(StartupError, match="laneway bus provision"):
        cluster_factory(
            workers=2,
            nats_url=own_servers.nats_plain,
            etcd_endpoints=own_servers.etcd_plain,
            bus_credentials=folder,
        )
    # Run again: the spent workers' users are gone from NATS's accounts and from etcd, and
    # fresh ones take their place.
    spent_creds = [Credentials.read(folder / "etcd" / f"{user}.json") for user in spent]
    assert asyncio.run(_etcd_login(spent_creds[0], own_servers.etcd_plain))
    assert main([*args, "--workers", "3"]) == 0
    accounts = (folder / NATS_ACCOUNTS_FILE).read_text()
    assert not any(user in accounts for user in spent)
    workers_now = {i.user for i in Provisioned(folder).identities() if i.role == "worker"}
    assert len(workers_now) == 3 and not workers_now & spent
    for creds in spent_creds:
        assert not asyncio.run(_etcd_login(creds, own_servers.etcd_plain))
