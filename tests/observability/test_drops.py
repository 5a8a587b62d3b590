"""Warnings anyone may cause at will: every drop counted, the log told once per reason per
interval with how many it left out."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from observability.drops import Drops, RateLimitedLog, count_drops_in


def test_a_burst_is_one_line_and_the_next_after_the_interval_says_how_many_it_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    logger = logging.getLogger("test.drops")
    limited = RateLimitedLog(logger, interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.drops"):
        logged = [limited.warning("forged", "dropping %d", i) for i in range(1000)]
        assert limited.warning("other", "another reason")  # limited on its own
        now[0] = 9.9
        assert not limited.warning("forged", "dropping late")
        now[0] = 10.0
        assert limited.warning("forged", "dropping again")
    assert logged == [True] + [False] * 999
    assert [r.getMessage() for r in caplog.records] == [
        "dropping 0",
        "another reason",
        "dropping again (and 1000 more such since the last one logged)",
    ]


def test_every_drop_is_counted_in_each_registry_that_takes_them_in() -> None:
    registries = [CollectorRegistry(), CollectorRegistry()]
    for registry in registries:
        count_drops_in(registry)

    def counted(registry: CollectorRegistry) -> float:
        found = registry.get_sample_value(
            "laneway_bus_dropped_events_total", {"reason": "test_reason"}
        )
        return found or 0.0

    before = counted(registries[0])
    drops = Drops(logging.getLogger("test.drops"))
    for _ in range(500):
        drops("test_reason", "dropping one")
    assert [counted(r) - before for r in registries] == [500, 500]
