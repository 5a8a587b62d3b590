"""A local cluster's bus credentials as `laneway up` hands them out: files of their owner's only,
never in a process's arguments or environment, and a worker restarted under a new id let in."""

from __future__ import annotations

import os
import signal
import stat
import threading
from pathlib import Path

import aetcd
import nats
import openai
import pytest
from nats.js.errors import NotFoundError

from bus.credentials import Credentials, split_credentials
from bus.registry import WORKERS_PREFIX, EtcdCluster, etcd_endpoints
from bus.topology import ROUTES
from infra.cluster import LocalCluster
from tests.helpers import eventually
from tests.live import ClusterFactory, registrations


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    return cluster_factory(workers=1)


def _secrets(cluster: LocalCluster) -> list[str]:
    return [
        Credentials.read(path).password
        for path in (cluster.config.state_dir / "auth").rglob("*.json")
    ]


def test_credentials_are_their_owners_only(cluster: LocalCluster) -> None:
    state = cluster.config.state_dir
    files = [*(state / "auth").rglob("*.json"), state / "nats.conf"]
    assert len(files) > 6  # admin, root, planner, indexer, ingress, worker; nats and etcd
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in (state / "auth", state / "auth" / "nats", state / "auth" / "etcd"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_no_password_is_in_a_process_argument_or_environment(cluster: LocalCluster) -> None:
    secrets = _secrets(cluster)
    assert secrets
    for name, pid in cluster.pids().items():
        seen = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        leaked = [s for s in secrets if s.encode() in seen]
        assert not leaked, f"{name} carries a password in its arguments or environment"
        if "worker" in name:
            assert b"LANEWAY_NATS_CREDS_FILE=" in seen


async def test_a_restarted_worker_gets_a_new_id_it_may_use(cluster: LocalCluster) -> None:
    """The supervisor restarts a killed worker under a new id, which gets a NATS and an etcd
    user of its own: it registers, and serves (it is the only worker). The old id is retired:
    whoever kept its credentials can neither connect to NATS nor log in to etcd."""
    [before] = await registrations(cluster.etcd_endpoints)
    folder = cluster.config.state_dir / "auth"
    old = {
        kind: Credentials.read(folder / kind / f"worker-{before}.json") for kind in ("nats", "etcd")
    }
    stop = threading.Event()
    supervising = threading.Thread(target=cluster.supervise, args=(stop,), daemon=True)
    supervising.start()
    try:
        worker = cluster.service("decode-worker-0")
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGKILL)

        async def new_worker() -> list[str]:
            found = await registrations(cluster.etcd_endpoints)
            return [w for w in found if w != before]

        [after] = await eventually(new_worker, timeout=30, interval=0.2)
        assert worker.env["LANEWAY_WORKER_ID"] == after
        client = openai.AsyncOpenAI(
            base_url=cluster.config.base_url, api_key=cluster.api_key, max_retries=0
        )
        reply = await client.chat.completions.create(
            model="laneway-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        # Its durable is the admin's work (a worker may make none), its predecessor's deleted.
        nc = await nats.connect(cluster.nats_url)
        try:
            js = nc.jetstream()
            assert (await js.consumer_info(ROUTES.name, f"worker-{after}")).num_pending == 0
            with pytest.raises(NotFoundError):
                await js.consumer_info(ROUTES.name, f"worker-{before}")
        finally:
            await nc.close()
        plain_nats = split_credentials(cluster.nats_url)[1]
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(old["nats"].within(plain_nats), allow_reconnect=False)
        plain_etcd = split_credentials(cluster.etcd_endpoints)[1]
        etcd = EtcdCluster(etcd_endpoints(plain_etcd), failover_s=0.0, credentials=old["etcd"])
        with pytest.raises(aetcd.exceptions.ClientError):
            await etcd.get(WORKERS_PREFIX + before.encode())
        await etcd.close()
        assert not (folder / "nats" / f"worker-{before}.json").exists()
    finally:
        stop.set()
        supervising.join(10)
