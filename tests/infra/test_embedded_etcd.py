"""The embedded etcd compacts its history and has a space quota: without them every write is
kept until etcd refuses all writes (NOSPACE)."""

from __future__ import annotations

from pathlib import Path

import httpx

from infra.embedded import ETCD_QUOTA_BYTES, EmbeddedServer


def test_etcd_runs_with_auto_compaction_and_a_quota(etcd_server: EmbeddedServer) -> None:
    args = Path(f"/proc/{etcd_server.proc.pid}/cmdline").read_bytes().decode().split("\0")
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--auto-compaction-mode"] == "periodic"
    assert flags["--auto-compaction-retention"] == "5m"
    # What the running server took, from its own metrics.
    metrics = httpx.get(f"http://{etcd_server.url}/metrics", timeout=5).text
    [quota] = [line for line in metrics.splitlines() if line.startswith("etcd_server_quota_")]
    assert float(quota.split()[-1]) == ETCD_QUOTA_BYTES
