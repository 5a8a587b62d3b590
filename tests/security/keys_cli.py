"""`laneway keys` run as an operator runs it, against a test cluster's etcd (the admin's
credentials ride on ``cluster.etcd_endpoints``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from infra.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]


def keys(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "keys", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def create(cluster: LocalCluster, *args: str) -> str:
    """A new key (``laneway keys create ARGS``), from the command's last line."""
    made = keys(cluster, "create", "--etcd-endpoints", cluster.etcd_endpoints, *args)
    assert made.returncode == 0, made.stderr
    return made.stdout.splitlines()[-1]
