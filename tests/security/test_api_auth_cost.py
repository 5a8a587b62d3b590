"""What API keys cost on the live path: two clusters side by side, one taking keys and one not,
asked the same completion in turn (so that both see the same machine load); the ratio of their
median latencies is printed and bounded. `slow`: 2 x 220 requests through every service."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest

from tests.live import ClusterFactory

pytestmark = pytest.mark.slow

REQUESTS = 200
WARM_UP = 20
BODY = {"model": "laneway-sim", "prompt": "Once upon a time", "max_tokens": 8}


def test_auth_costs_little_on_the_live_path(cluster_factory: ClusterFactory) -> None:
    plain = cluster_factory(workers=1, api_auth=False)
    keyed = cluster_factory(workers=1)
    clients = {
        "plain": httpx.Client(base_url=plain.config.base_url, timeout=30),
        "keyed": httpx.Client(
            base_url=keyed.config.base_url,
            timeout=30,
            headers={"Authorization": f"Bearer {keyed.api_key}"},
        ),
    }
    took: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for i in range(WARM_UP + REQUESTS):
            for name, client in clients.items():
                start = time.perf_counter()
                reply = client.post("/completions", json=BODY)
                elapsed = time.perf_counter() - start
                assert reply.status_code == 200, reply.text
                if i >= WARM_UP:
                    took[name].append(elapsed)
    finally:
        for client in clients.values():
            client.close()
    median = {name: statistics.median(times) for name, times in took.items()}
    ratio = median["keyed"] / median["plain"]
    print(
        f"\nauth cost over {REQUESTS} sequential requests each: median "
        f"{median['plain'] * 1000:.2f} ms without keys, {median['keyed'] * 1000:.2f} ms with; "
        f"ratio {ratio:.3f}; means {statistics.mean(took['plain']) * 1000:.2f} / "
        f"{statistics.mean(took['keyed']) * 1000:.2f} ms"
    )
    # The check itself is one SHA-256 and a dict look-up; the bound leaves room for a noisy,
    # shared machine, not for a real slowdown.
    assert ratio < 1.25
