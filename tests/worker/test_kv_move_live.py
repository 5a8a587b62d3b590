"""KV moves between live sim workers over a real nats-server: a worker told to pull a prompt's KV
from the worker that holds it gets the blocks (announcing them in its KV events), computes only
the rest of the prompt, and answers exactly as without the move; a holder that is gone, silent or
holds none of the blocks costs a recompute, never the request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from bus.blobs import BLOB_ID_HEADER, CHUNK_HEADER
from bus.client import Bus
from bus.credentials import inbox_prefix
from bus.registry import WORKERS_PREFIX, LeasedKey, connect_etcd
from bus.topology import Subjects
from infra.embedded import EmbeddedServer
from schemas.block_hash import chain_block_hashes
from schemas.codec import decode_as, encode
from schemas.events import (
    CancellationRequested,
    Event,
    KvChanged,
    KvMove,
    KvPayload,
    KvTransferred,
    RequestCancelled,
    RequestFinished,
    RequestSpec,
    RouteDecided,
    SamplingParams,
)
from schemas.messages import KvPullQuery, KvPullReply
from services.common.perf_model import FixedPerf
from services.common.tokenizer import ByteTokenizer
from services.engine.protocol import Engine, StepResult, decode_runs
from services.engine.sim import SimConfig, SimEngine
from services.engine.torch_engine import TorchEngine, TorchEngineConfig
from services.worker.driver import EngineDriver
from services.worker.kv_move import KvMoves, blob_id
from services.worker.outputs import Background
from services.worker.parts import WorkerParts
from services.worker.runtime import Worker
from services.worker.settings import WorkerOptions
from tests.engine.torch_engine.tiny_checkpoint import write_tiny_checkpoint
from tests.helpers import eventually, routed, stored_blocks

BLOCK = 16
PROMPT = tuple(range(1, 8 * BLOCK + 6))  # eight full blocks and five tokens
HASHES = chain_block_hashes(PROMPT, BLOCK)
INGRESS = "moveingress"


def route(request_id: str, worker_id: str, move: KvMove | None = None) -> RouteDecided:
    spec = RequestSpec(
        model="m",
        prompt_token_ids=PROMPT,
        block_size=BLOCK,
        block_hashes=HASHES,
        sampling=SamplingParams(max_tokens=6, seed=18, temperature=0.0, ignore_eos=True),
        reply_to=INGRESS,
        deadline=datetime(2100, 1, 1, tzinfo=UTC),
    )
    return routed(request_id, worker_id, spec, kv_move=move)


def move_from(source: str, transfer_ms: float = 30.0) -> KvMove:
    return KvMove(source_worker_id=source, blocks=len(HASHES), transfer_ms=transfer_ms)


class Seen:
    def __init__(self) -> None:
        self.events: list[Event] = []

    async def on(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type[Event], request_id: str | None = None) -> list[Event]:
        return [
            e
            for e in self.events
            if isinstance(e, kind) and (request_id is None or e.request_id == request_id)
        ]

    def finished(self, request_id: str) -> RequestFinished | None:
        done = self.of(RequestFinished, request_id)
        return done[0] if done and isinstance(done[0], RequestFinished) else None


class Recorded:
    """An engine whose steps are recorded: the tokens it produced for each request, and the
    prompt tokens it computed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.prefilled = 0
        step = engine.step
        runs = decode_runs(engine)

        def record(result: StepResult | None) -> StepResult | None:
            if result is not None:
                self.prefilled += result.prefill_tokens
                for output in result.outputs:
                    self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            return result

        def recorded() -> StepResult:
            result = step()
            record(result)
            return result

        setattr(engine, "step", recorded)  # noqa: B010 (an instance's method, replaced)
        if runs is not None:
            run_steps = runs.run_steps
            setattr(engine, "run_steps", lambda until_s: record(run_steps(until_s)))  # noqa: B010


def sim_engine() -> Engine:
    return SimEngine(SimConfig(block_size=BLOCK, num_gpu_blocks=64), FixedPerf())


@contextlib.asynccontextmanager
async def workers(
    bus: Bus,
    etcd_server: EmbeddedServer,
    *names: str,
    engine: Callable[[], Engine] = sim_engine,
) -> AsyncIterator[tuple[Seen, dict[str, Recorded]]]:
    """Workers of ``names`` (sim ones by default: one ms of modelled time is one ms), and what
    they publish."""
    seen = Seen()
    await bus.subscribe(Subjects.request_terminal(INGRESS), seen.on)
    await bus.subscribe(Subjects.all_routes, seen.on)
    await bus.subscribe(Subjects.all_kv, seen.on)
    etcd = connect_etcd(etcd_server.url)
    # Connected before any engine is built: in a test process that has run a cluster before, a
    # first etcd call made after torch engines were built in the loop never got its answer.
    await etcd.get(WORKERS_PREFIX)
    stop = asyncio.Event()
    engines: dict[str, Recorded] = {}
    started = []
    # Every engine built before any worker starts: loading a model holds the event loop.
    for name in names:
        engines[name] = recorded = Recorded(engine())
        options = WorkerOptions(name, "both", "sim", "m", 1.0, 5, 1.0, 1.0)
        options.handoff_timeout_s, options.handoff_timeout_factor = 1.0, 2.0
        started.append(Worker(bus, recorded.engine, ByteTokenizer(), options))
    running = []
    for worker in started:
        lease = LeasedKey.worker(etcd, worker.registration(), 5)
        task = asyncio.create_task(worker.run(lease, stop))
        running.append(task)

        def serving(w: Worker = worker, t: asyncio.Task[None] = task) -> bool:
            if t.done():
                t.result()  # it failed to start: say why
            return w.serving

        await eventually(serving, timeout=20.0)
    try:
        yield seen, engines
    finally:
        stop.set()
        await asyncio.gather(*running)
        await etcd.close()


async def answer(bus: Bus, seen: Seen, event: RouteDecided) -> RequestFinished:
    await bus.publish(Subjects.route(event.worker_id), event)
    assert event.request_id is not None
    request_id = event.request_id
    return await eventually(lambda: seen.finished(request_id), timeout=10.0)


async def test_a_moved_prompt_is_pulled_announced_and_answered_as_without_the_move(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    async with workers(bus, etcd_server, "mvsrc", "mvdst", "mvctl") as (seen, engines):
        await answer(bus, seen, route("warm", "mvsrc"))
        control = await answer(bus, seen, route("control", "mvctl"))
        moved = await answer(bus, seen, route("moved", "mvdst", move_from("mvsrc")))
        answers = engines["mvdst"].tokens["moved"], engines["mvctl"].tokens["control"]
        assert answers[0] == answers[1] and len(answers[0]) == 6
        assert moved.usage.completion_tokens == control.usage.completion_tokens == 6
        # Everything but the last prompt token came with the move.
        assert control.usage.cached_tokens == 0
        assert moved.usage.cached_tokens == len(HASHES) * BLOCK == 128
        assert (engines["mvdst"].prefilled, engines["mvctl"].prefilled) == (
            len(PROMPT) - 128,
            len(PROMPT),
        )
        [transferred] = seen.of(KvTransferred, "moved")
        assert isinstance(transferred, KvTransferred)
        assert (transferred.from_worker_id, transferred.to_worker_id) == ("mvsrc", "mvdst")
        assert transferred.block_hashes == HASHES
        # The modelled link time (30 ms) was waited out by the request's first step.
        assert transferred.transfer_ms >= 30.0 and moved.ttft_ms >= 30.0
        # The target announced the moved blocks, so the index learns them.
        stored = stored_blocks(seen.of(KvChanged), "mvdst")
        assert stored[: len(HASHES)] == list(HASHES)
        assert set(HASHES) <= cast(SimEngine, engines["mvdst"].engine).cached_block_hashes()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


async def test_torch_workers_move_real_kv_and_answer_token_for_token(
    bus: Bus, etcd_server: EmbeddedServer, tiny_model_dir: Path
) -> None:
    def torch_engine() -> Engine:
        return TorchEngine(tiny_model_dir, TorchEngineConfig(block_size=BLOCK, num_gpu_blocks=64))

    names = ("tmsrc", "tmdst", "tmctl")
    async with workers(bus, etcd_server, *names, engine=torch_engine) as (seen, engines):
        await answer(bus, seen, route("t-warm", "tmsrc"))
        control = await answer(bus, seen, route("t-control", "tmctl"))
        moved = await answer(bus, seen, route("t-moved", "tmdst", move_from("tmsrc")))
        answers = engines["tmdst"].tokens["t-moved"], engines["tmctl"].tokens["t-control"]
        assert answers[0] == answers[1] and len(answers[0]) == 6
        # The K and V of eight blocks came over the bus: only five prompt tokens were computed.
        assert (engines["tmdst"].prefilled, engines["tmctl"].prefilled) == (5, len(PROMPT))
        assert (moved.usage.cached_tokens, control.usage.cached_tokens) == (128, 0)
        [transferred] = seen.of(KvTransferred, "t-moved")
        assert isinstance(transferred, KvTransferred) and transferred.block_hashes == HASHES
        assert set(HASHES) <= set(stored_blocks(seen.of(KvChanged), "tmdst"))


async def test_a_holder_that_is_gone_silent_empty_or_lying_costs_a_recompute(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    silent: list[bytes] = []

    async def ignore(msg: object) -> None:
        silent.append(b"")

    await bus.subscribe_bytes(Subjects.kv_pull("mvmute").subject, ignore)

    def lying(reply: KvPullReply) -> Callable[[Msg], Awaitable[None]]:
        """A holder that sends two bytes of chunk and answers ``reply``."""

        async def answer(msg: Msg) -> None:
            query = decode_as(KvPullQuery, msg.data)
            blob = blob_id(query.request_id, query.attempt)
            headers = {BLOB_ID_HEADER: blob, CHUNK_HEADER: "0"}
            await bus.publish_bytes(Subjects.kv_handoff(query.to_worker_id), b"xx", headers)
            await msg.respond(encode(reply))

        return answer

    garbled = KvPayload(chunks=1, size=2, sha256="0" * 64)
    await bus.subscribe_bytes(
        Subjects.kv_pull("mvgarbled").subject, lying(KvPullReply(blocks=8, payload=garbled))
    )
    await bus.subscribe_bytes(Subjects.kv_pull("mvgreedy").subject, lying(KvPullReply(blocks=9)))
    targets = {
        "gone": "mvnobody",
        "mute": "mvmute",
        "empty": "mvempty",
        "garbled": "mvgarbled",
        "greedy": "mvgreedy",
    }
    names = ("mvempty", "mvctl2", "mvdst-cancel", *(f"mvdst-{r}" for r in targets))
    async with workers(bus, etcd_server, *names) as (seen, engines):
        control = await answer(bus, seen, route("control2", "mvctl2"))
        for request_id, source in targets.items():
            target = f"mvdst-{request_id}"
            done = await answer(bus, seen, route(request_id, target, move_from(source)))
            # Recomputed once: the whole answer, exactly, the prompt not served from cache.
            assert engines[target].tokens[request_id] == engines["mvctl2"].tokens["control2"]
            assert engines[target].prefilled == len(PROMPT)
            assert len(seen.of(RequestFinished, request_id)) == 1
            assert (done.worker_id, done.usage.cached_tokens) == (target, 0)
            assert done.usage.completion_tokens == control.usage.completion_tokens
            assert not seen.of(KvTransferred, request_id)
        # The silent holder was asked, and the wait for it bounded (1 s here).
        assert silent
        # Cancelled while its KV is awaited: it ends once, cancelled, and never runs.
        asked = len(silent)
        await bus.publish(
            Subjects.route("mvdst-cancel"), route("cancel", "mvdst-cancel", move_from("mvmute"))
        )
        await eventually(lambda: len(silent) > asked)
        cancel = CancellationRequested(source="test", request_id="cancel", reason="timeout")
        await bus.publish(Subjects.cancellation_requested, cancel)
        await eventually(lambda: seen.of(RequestCancelled, "cancel"))
        await asyncio.sleep(1.5)  # past the pull's deadline
        assert len(seen.of(RequestCancelled, "cancel")) == 1
        assert not seen.of(RequestFinished, "cancel")
        assert "cancel" not in engines["mvdst-cancel"].tokens
        assert engines["mvdst-cancel"].prefilled == 0


async def test_the_holder_sends_only_blocks_it_holds_to_the_worker_that_asks(
    bus: Bus, etcd_server: EmbeddedServer
) -> None:
    async with workers(bus, etcd_server, "mvhold") as (seen, _):
        await answer(bus, seen, route("held", "mvhold"))

        async def ask(to: str, hashes: tuple[int, ...]) -> KvPullReply:
            query = KvPullQuery(request_id="q", to_worker_id=to, block_hashes=hashes)
            return await bus.request(Subjects.kv_pull("mvhold"), query, 2.0)

        # What it holds of a longer chain: its leading blocks, modelled (no payload).
        longer = chain_block_hashes([*PROMPT[: 8 * BLOCK], *range(500, 532)], BLOCK)
        assert await ask("mvasker", longer) == KvPullReply(blocks=len(HASHES))
        assert (await ask("mvasker", (12345,))).error == "none of the blocks is held here"
        assert (await ask("mv.asker", HASHES)).error == "not a worker id"
        too_many = tuple(range(65))  # its pool has 64 blocks
        assert (await ask("mvasker", too_many)).error == "more blocks than this worker's KV holds"


async def test_with_bus_auth_kv_goes_only_to_the_worker_named() -> None:
    unused = cast(Any, None)  # what answering a pull does not reach for
    parts = WorkerParts(unused, unused, EngineDriver(sim_engine(), 1.0), unused, Background())
    moves = KvMoves(cast(Bus, None), parts, CollectorRegistry())
    replies: list[KvPullReply] = []

    class Asked:
        data = encode(KvPullQuery(request_id="q", to_worker_id="victim", block_hashes=HASHES))

        def __init__(self, reply: str) -> None:
            self.reply = reply

        async def respond(self, data: bytes) -> None:
            replies.append(decode_as(KvPullReply, data))

    # Another worker's inbox (its bus user's): refused; the victim's own: answered.
    await moves.on_pull(cast(Msg, Asked(inbox_prefix("worker-thief") + ".1")))
    await moves.on_pull(cast(Msg, Asked(inbox_prefix("worker-victim") + ".1")))
    assert [r.error for r in replies] == [
        "the asker is not the worker named",
        "none of the blocks is held here",
    ]
