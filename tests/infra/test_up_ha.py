"""The HA shape (`laneway up --ha`): the API served on a 3-node JetStream cluster and a 3-member
etcd cluster, every stream on three servers, every service given every member."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bus.client import Bus
from bus.topology import STREAM_SUBJECTS
from infra.cli import build_parser
from infra.cluster import LocalCluster
from infra.cluster_plan import ClusterConfig
from infra.startup import StartupError
from tests.live import ClusterFactory, registrations


async def test_ha_cluster_serves_on_three_nats_nodes_and_three_etcd_members(
    cluster_factory: ClusterFactory,
) -> None:
    assert build_parser().parse_args(["up", "--ha"]).ha
    cluster = cluster_factory(workers=2, ha=True)
    names = sorted(server.name for server in cluster.servers)
    assert names == ["etcd-0", "etcd-1", "etcd-2", "nats-0", "nats-1", "nats-2"]
    assert len(cluster.nats_url.split(",")) == len(cluster.etcd_endpoints.split(",")) == 3
    assert len(await registrations(cluster.etcd_endpoints)) == 2
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30
    ) as http:
        body = {"model": "laneway-sim", "prompt": "hello", "max_tokens": 4, "stream": True}
        reply = await http.post("/completions", json=body)
    assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")
    bus = await Bus.connect(cluster.nats_url, "test-ha")
    try:
        js = bus.nc.jetstream()
        for stream in STREAM_SUBJECTS:
            assert (await js.stream_info(stream.name)).config.num_replicas == 3
    finally:
        await bus.close()


def test_ha_takes_no_single_server_ports(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterConfig(state_dir=tmp_path, ha=True, nats_port=4222))
    with pytest.raises(StartupError, match="--ha starts three of each on free ports"):
        cluster.start()
    assert not cluster.servers
