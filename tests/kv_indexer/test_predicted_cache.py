from __future__ import annotations

from schemas.events import (
    PrefillPlacement,
    RequestSpec,
    RouteDecided,
    SamplingParams,
    utc_now,
)
from schemas.messages import OverlapQueries, OverlapQuery, WorkerRegistration
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.indexer import Indexer
from services.common.kv_index.predicted import PredictedCache
from tests.helpers import registration as small_worker


def registration(worker_id: str) -> WorkerRegistration:
    """A worker without KV events: the indexer predicts its cache."""
    role = "prefill" if worker_id == "prefill" else "decode"
    update = {"role": role, "kv_blocks_total": 100, "kv_events": False}
    return small_worker(worker_id).model_copy(update=update)


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


async def test_a_remote_prefill_is_predicted_on_both_workers() -> None:
    indexer = Indexer(PrefixIndex())
    workers = {w: registration(w) for w in ("decode", "prefill")}
    await indexer.on_workers(workers)
    spec = RequestSpec(
        model="m",
        prompt_token_ids=tuple(range(32)),
        block_size=16,
        block_hashes=(11, 12),
        sampling=SamplingParams(max_tokens=4),
        reply_to="i",
        deadline=utc_now(),
    )
    placement = PrefillPlacement(prefill_worker_id="prefill", local_ms=9.0, reason="test")
    await indexer.on_route(
        RouteDecided(
            source="t", request_id="r", worker_id="decode", policy="kv", reason="test",
            candidates=(), spec=spec, prefill=placement,
        )
    )  # fmt: skip
    reply = await indexer.on_query(OverlapQuery(block_hashes=(11, 12, 13)))
    assert reply.overlaps == {"decode": 2, "prefill": 2}


async def test_only_predicted_workers_routes_are_followed_and_each_once() -> None:
    followed: list[str] = []

    async def follow(worker_id: str) -> None:
        followed.append(worker_id)

    indexer = Indexer(PrefixIndex(), follow_routes=follow)
    with_events = small_worker("with-events")
    assert with_events.kv_events
    workers = {"with-events": with_events, "decode": registration("decode")}
    await indexer.on_workers(workers)
    await indexer.on_workers({"with-events": with_events})  # decode leaves
    await indexer.on_workers(workers)  # and comes back: its subscription still stands
    assert followed == ["decode"]


async def test_a_batch_of_queries_is_answered_as_each_alone() -> None:
    indexer = Indexer(PrefixIndex())
    indexer.index.store("a", [1, 2, 3])
    indexer.index.store("b", [1, 7])
    queries = tuple(OverlapQuery(block_hashes=h) for h in ((1, 2, 3, 4), (1, 7), (9,), (1, 2)))
    batch = await indexer.on_queries(OverlapQueries(queries=queries))
    assert batch.replies == tuple([await indexer.on_query(q) for q in queries])
    assert [r.overlaps for r in batch.replies] == [
        {"a": 3, "b": 1},
        {"a": 1, "b": 2},
        {},
        {"a": 2, "b": 1},
    ]
