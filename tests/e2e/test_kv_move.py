"""KV moves through the whole live system: with LANEWAY_KV_MOVES the planner's one decision sends
requests sharing a hot prefix to an idle worker with the prefix's KV pulled from the busy worker
holding it; the move is explained in RouteDecided, the idle worker reports the moved blocks and
computes only the rest of the prompt, and every stream is the one its seed gives."""

from __future__ import annotations

import asyncio
from functools import partial

import httpx
import pytest

from bus.topology import Subjects
from infra.cluster import LocalCluster
from schemas.events import KvTransferred, RequestFinished, RouteDecided
from tests.e2e.exact import MODEL, Streamed, mismatch, stream_body
from tests.helpers import eventually, stored_blocks
from tests.ingress.helpers import sse_data
from tests.live import ClusterFactory, Observed, api_block_hashes, observe, registrations

# In `make test-slow`, not `make test`: in the full parallel suite on 2 cores it went without a
# move in all three rounds 2 times in 5 runs (alone, and beside 6 busy loops, it moved every
# time), a cause not found yet. The kv policy's move decision has its unit tests
# (tests/planner/test_kv_moves.py) and a worker's KV move its live one
# (tests/worker/test_kv_move_live.py) in `make test`.
pytestmark = pytest.mark.slow

BLOCK = 16
# A 6,000-token prefix (the sim's tokenizer: a token a byte) and 3,000 tokens of each request's
# own. Modelled time runs 20 times slower than the clock, so the queue the planner predicts on
# the prefix's worker is there when the next request comes.
PREFIX = "".join(f"shared context line {i:04d}. " for i in range(240))[:6000]
# The overlap answer is what shows the prefix's worker: on a loaded machine it may take more than
# the planner's 50 ms, and a request routed on load alone has nothing to move.
ENV = {
    "LANEWAY_KV_MOVES": "1",
    "LANEWAY_KV_MOVE_MARGIN_MS": "0",
    "LANEWAY_SPEEDUP": "0.05",
    "LANEWAY_OVERLAP_TIMEOUT_S": "2",
}
SEED, MAX_TOKENS = 7, 6


async def streamed(http: httpx.AsyncClient, prompt: str) -> tuple[str, Streamed]:
    body = {**stream_body(SEED, MAX_TOKENS), "prompt": prompt}
    async with http.stream("POST", "/completions", json=body) as response:
        raw = (await response.aread()).decode()
    events = sse_data(raw) if response.status_code == 200 else [raw]
    chunks = [e for e in events if isinstance(e, dict)]
    return chunks[0]["id"].removeprefix("cmpl-"), Streamed(
        SEED, MAX_TOKENS, response.status_code, events
    )


def _routes(seen: Observed, request_ids: list[str]) -> list[RouteDecided] | None:
    """The route of each request, once every one was heard."""
    routes = [e for rid in request_ids for e in seen.of(RouteDecided, rid)]
    if len(routes) < len(request_ids):
        return None
    return [r for r in routes if isinstance(r, RouteDecided)]


def blocks_stored(seen: Observed, worker_id: str) -> set[int]:
    return set(stored_blocks(seen.events["KvChanged"], worker_id))


async def test_a_hot_prefix_moves_to_an_idle_worker_and_every_stream_is_exact(
    cluster_factory: ClusterFactory,
) -> None:
    cluster: LocalCluster = cluster_factory(workers=2, env=ENV)
    bus, seen = await observe(cluster.nats_url)
    await bus.subscribe(Subjects.all_kv, seen.on_event)
    workers = await registrations(cluster.etcd_endpoints)
    prefix_hashes = await api_block_hashes(cluster, list(PREFIX.encode()), BLOCK)
    async with httpx.AsyncClient(
        base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=60.0
    ) as http:
        try:
            body = {"model": MODEL, "prompt": "a story", "max_tokens": MAX_TOKENS, "seed": SEED}
            whole = (await http.post("/completions", json=body)).raise_for_status().json()
            expected = whole["choices"][0]["text"]
            # The prefix is computed once, on one worker, and the index hears of it.
            warm = {"model": MODEL, "prompt": PREFIX, "max_tokens": 1}
            (await http.post("/completions", json=warm)).raise_for_status()
            owner = await eventually(
                lambda: next(
                    (w for w in workers if set(prefix_hashes) <= blocks_stored(seen, w)),
                    None,
                ),
                timeout=20.0,
            )
            # Four at once: the first queues on the prefix's worker, the next move. On a loaded
            # machine a round can go without a move (an overlap answer late, a queue drained
            # before the next request came): up to three rounds, each stream exact.
            results: list[tuple[str, Streamed]] = []
            moved: list[tuple[str, RouteDecided]] = []
            for round_ in range(3):
                prompts = [PREFIX + f" request {round_}.{n}: " + "x" * 3000 for n in range(4)]
                this = await asyncio.gather(*(streamed(http, p) for p in prompts))
                results.extend(this)
                routes = await eventually(partial(_routes, seen, [r for r, _ in this]), timeout=5)
                moved.extend((r.request_id or "", r) for r in routes if r.kv_move is not None)
                if moved:
                    break
        finally:
            await bus.close()
    wrong = [m for _, s in results if (m := mismatch(s, expected)) is not None]
    assert not wrong, wrong
    assert moved, [
        (r.worker_id, r.reason, [(c.worker_id, c.cached_blocks, c.cost) for c in r.candidates])
        for rid, _ in results
        for r in seen.of(RouteDecided, rid)
        if isinstance(r, RouteDecided)
    ]
    for request_id, route in moved:
        move = route.kv_move
        assert move is not None and move.source_worker_id == owner != route.worker_id
        assert {a.action for a in move.alternatives} == {"owner", "move", "recompute"}
        options = {a.action: a for a in move.alternatives}
        assert options["move"].worker_id == route.worker_id
        assert options["owner"].worker_id == owner
        # Moved only for a first token predicted sooner than waiting on the prefix's worker.
        assert options["move"].predicted_ttft_ms < options["owner"].predicted_ttft_ms
        [arrived] = seen.of(KvTransferred, request_id)
        assert isinstance(arrived, KvTransferred)
        assert (arrived.from_worker_id, arrived.to_worker_id) == (owner, route.worker_id)
        assert arrived.block_hashes == prefix_hashes[: len(arrived.block_hashes)]
        assert len(arrived.block_hashes) >= move.blocks - 1
        # The target announced the moved blocks and served them from its cache.
        assert set(arrived.block_hashes) <= blocks_stored(seen, route.worker_id)
        [done] = seen.of(RequestFinished, request_id)
        assert isinstance(done, RequestFinished) and done.worker_id == route.worker_id
        assert done.usage.cached_tokens >= len(arrived.block_hashes) * BLOCK
