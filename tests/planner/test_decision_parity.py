"""The live planner and the offline replay decide alike: one recorded sequence of decision inputs,
taken from an offline replay, is played to the live planner's handlers over a real NATS and etcd
(the same registrations, load reports, overlaps and finished requests), and every decision it
publishes equals the offline one, field for field; each can be made again from its event alone.
The output length predictor is on in both: the live one learns from the finished requests, in the
order the offline one did, and predicts the same lengths."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from bus.client import Bus
from bus.registry import LeasedKey, connect_etcd, watch_workers
from bus.topology import Subjects
from infra.bench.offline import OfflineReplay
from infra.bench.tiers import TierSettings
from infra.bench.traces import TraceRequest
from infra.cluster_auth import ClusterAuth
from infra.embedded import EmbeddedServer
from schemas.events import (
    RequestAccepted,
    RequestFinished,
    RequestSpec,
    RouteDecided,
    SamplingParams,
    Usage,
    WorkerLoadReported,
    utc_now,
)
from schemas.messages import OverlapQueries, OverlapReplies, OverlapReply, WorkerRegistration
from services.engine.sim import SimConfig
from services.planner.decision import Decision, DecisionInputs
from services.planner.disagg import DisaggSettings
from services.planner.handlers import Planner
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.output_length import OutputLengthPredictor
from services.planner.policy import WorkerView
from services.planner.replay import differences, redecide
from tests.helpers import eventually
from tests.live import admin_etcd

CONFIG = SimConfig(block_size=64, num_gpu_blocks=512, max_num_seqs=8)
DISAGG = DisaggSettings(mode="auto", min_remote_tokens=256)
REPLY_TO = "parity"


def _trace() -> list[TraceRequest]:
    """Conversations that grow (shared prefixes), some long prompts, one-token answers too."""
    trace = []
    for i in range(36):
        conversation = i % 4
        turn = i // 4
        blocks = tuple(conversation * 100 + k for k in range(2 + turn + 3 * (conversation == 0)))
        trace.append(
            TraceRequest(
                arrival_s=0.01 * i,
                input_length=512 * len(blocks) - 37 * (i % 3),
                output_length=1 if i % 7 == 3 else 6 + 5 * (i % 5),
                hash_ids=blocks,
                index=i,
            )
        )
    return trace


def _policy() -> KvAware:
    return KvAware(KvSettings(perf_model=CONFIG.perf_model), seed=3)


Lesson = tuple[int, int, int, int]


def _offline() -> tuple[list[tuple[DecisionInputs, Decision]], list[Lesson]]:
    """The decisions, and what the predictor learned before each (``OutputLengths.lessons``)."""
    predicted = TierSettings(output_length="predicted")
    replay = OfflineReplay(
        _trace(), _policy(), 2, CONFIG, prefill_workers=1, disagg=DISAGG, tiers=predicted
    )
    replay.decisions, replay.lengths.lessons = [], []
    replay.run()
    return replay.decisions, replay.lengths.lessons


def _registration(worker_id: str, role: str) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id,
        role="prefill" if role == "prefill" else "decode",
        engine="sim",
        model="laneway-sim",
        block_size=CONFIG.block_size,
        kv_blocks_total=CONFIG.num_gpu_blocks,
        max_num_seqs=CONFIG.max_num_seqs,
        kv_handoff=True,
        pid=os.getpid(),
    )


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """An etcd of this test's own: the session's holds other tests' leases, which a planner
    there would see too (the bus is an in-memory broker of the test's own already)."""
    etcd = admin_etcd(ClusterAuth(tmp_path / "auth", []), tmp_path)
    yield etcd
    etcd.stop()


@pytest.mark.live
async def test_live_and_offline_decide_alike_field_for_field(
    bus: Bus, own_etcd: EmbeddedServer
) -> None:
    recorded, lessons = _offline()
    assert any(d.prefill_worker_id for _, d in recorded), "no remote prefill to compare"
    assert any(d.prefill_worker_id is None for _, d in recorded)
    # Learned lengths, some taught before later decisions: predictions that change.
    expected = {d.expected_output_tokens for _, d in recorded}
    assert None not in expected and len(expected) > 2, expected
    assert lessons and lessons[0][0] < len(recorded)
    first = recorded[0][0]
    roles = {w.worker_id: "decode" for w in first.decoders}
    roles |= {w.worker_id: "prefill" for w in first.prefillers}

    etcd = connect_etcd(own_etcd.url)
    planner = Planner(
        bus,
        _policy(),
        "parity",
        overlap_timeout_s=2.0,
        disagg=DISAGG,
        lengths=OutputLengthPredictor(),
    )
    leases = [LeasedKey.worker(etcd, _registration(w, r), ttl_s=10) for w, r in roles.items()]
    for lease in leases:
        await lease.start()
    watch = asyncio.create_task(watch_workers(etcd, planner.on_workers))
    published: dict[str, RouteDecided] = {}

    async def on_route(event: RouteDecided) -> None:
        published[event.event_id] = event

    overlaps: dict[tuple[int, ...], dict[str, int]] = {}

    async def on_overlap(batch: OverlapQueries) -> OverlapReplies:
        return OverlapReplies(
            replies=tuple(
                OverlapReply(overlaps=overlaps[q.block_hashes], indexed_blocks=0)
                for q in batch.queries
            )
        )

    await planner.attach()
    await bus.subscribe(Subjects.route_decisions, on_route)
    await bus.serve(Subjects.overlap_queries, on_overlap, queue="parity")
    try:
        await eventually(lambda: len(planner.cluster.workers) == len(roles))
        open_routes: dict[str, list[str]] = {w: [] for w in roles}
        for k, (inputs, offline) in enumerate(recorded):
            cached = {
                v.worker_id: v.cached_blocks
                for v in [*inputs.decoders, *inputs.prefillers]
                if v.cached_blocks
            }
            overlaps[inputs.request.block_hashes] = cached
            taught = [lesson for lesson in lessons if lesson[0] == k]
            await _as_offline_saw_it(bus, planner, inputs, cached, open_routes, roles, taught)
            await bus.publish(Subjects.request_accepted, _accepted(inputs))
            event_id = f"route-{inputs.request.request_id}"
            live = await eventually(partial(published.get, event_id), timeout=10)
            assert {k: getattr(live, k) for k in offline.route_fields()} == offline.route_fields()
            open_routes[live.worker_id].append(inputs.request.request_id)
        # Each published decision carries all it was made from: deciding again from the event
        # alone, off the bus, gives it back term for term.
        for event in published.values():
            assert differences(event, redecide(event, _policy(), DISAGG)) == []
    finally:
        watch.cancel()
        for lease in leases:
            await lease.stop()
        await etcd.close()


async def _as_offline_saw_it(
    bus: Bus,
    planner: Planner,
    inputs: DecisionInputs,
    cached: dict[str, int],
    open_routes: dict[str, list[str]],
    roles: dict[str, str],
    taught: list[Lesson],
) -> None:
    """Bring the live planner's view to what the offline replay saw: the requests offline had
    finished by then end, in the order its predictor learned them, with their lengths, and
    every worker reports the load it had."""
    for _, i, prompt_tokens, output_tokens in taught:
        request_id = f"r{i}"
        worker_id = next(w for w, ids in open_routes.items() if request_id in ids)
        open_routes[worker_id].remove(request_id)
        finished = _finished(request_id, worker_id, prompt_tokens, output_tokens)
        await bus.publish(Subjects.request_terminal(REPLY_TO, worker_id), finished)
    for view in inputs.decoders:
        assert len(open_routes[view.worker_id]) == view.in_flight, view.worker_id
    for view in [*inputs.decoders, *inputs.prefillers]:
        await bus.publish(Subjects.load(view.worker_id), _load(view, roles))
    await eventually(
        lambda: planner.cluster.decision_inputs(inputs.request, cached, None) == inputs,
        message=f"the live view before {inputs.request.request_id} is not the offline one",
    )


def _load(view: WorkerView, roles: dict[str, str]) -> WorkerLoadReported:
    total = view.kv_capacity_tokens // view.block_size
    return WorkerLoadReported(
        source="test/parity",
        worker_id=view.worker_id,
        role="prefill" if roles[view.worker_id] == "prefill" else "decode",
        running=view.running,
        waiting=view.waiting,
        waiting_prefill_tokens=view.waiting_prefill_tokens,
        kv_blocks_used=round(view.kv_usage * total),
        kv_blocks_total=total,
    )


def _finished(
    request_id: str, worker_id: str, prompt_tokens: int, output_tokens: int
) -> RequestFinished:
    return RequestFinished(
        source="test/parity",
        request_id=request_id,
        worker_id=worker_id,
        finish_reason="length",
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=output_tokens),
        ttft_ms=1.0,
        e2e_ms=2.0,
    )


def _accepted(inputs: DecisionInputs) -> RequestAccepted:
    request = inputs.request
    return RequestAccepted(
        source="test/parity",
        request_id=request.request_id,
        spec=RequestSpec(
            model="laneway-sim",
            prompt_token_ids=(65,) * request.prompt_tokens,
            block_size=CONFIG.block_size,
            block_hashes=request.block_hashes,
            sampling=SamplingParams(max_tokens=request.max_tokens, ignore_eos=True),
            reply_to=REPLY_TO,
            deadline=utc_now().replace(year=utc_now().year + 1),
        ),
    )
