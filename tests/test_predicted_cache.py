from __future__ import annotations

from services.kv_indexer.predicted import PredictedCache


def test_routed_prompts_are_predicted_cached_until_they_expire() -> None:
    cache = PredictedCache(ttl_s=10)
    cache.track("w", capacity_blocks=100)
    cache.routed("w", [1, 2, 3], now=0)
    assert cache.overlaps([1, 2, 3, 4], now=5) == {"w": 3}
    assert cache.overlaps([2, 3], now=5) == {"w": 2}
    assert cache.overlaps([1, 2], now=11) == {}


def test_capacity_pushes_out_the_least_recently_routed() -> None:
    cache = PredictedCache(ttl_s=100)
    cache.track("w", capacity_blocks=4)
    cache.routed("w", [1, 2], now=0)
    cache.routed("w", [3, 4], now=1)
    cache.routed("w", [1, 2], now=2)  # touched again: now the most recent
    cache.routed("w", [5, 6], now=3)
    assert cache.overlaps([1, 2], now=4) == {"w": 2}
    assert cache.overlaps([3], now=4) == {}


def test_only_tracked_workers_are_predicted() -> None:
    cache = PredictedCache(ttl_s=100)
    cache.routed("untracked", [1], now=0)
    assert cache.overlaps([1], now=0) == {}
    cache.track("w", 10)
    cache.routed("w", [1], now=0)
    cache.forget("w")
    assert cache.overlaps([1], now=0) == {}
