"""KV moves between workers: a worker the planner sent a request with a ``kv_move`` pulls the
prompt's leading blocks from the worker holding them (its GPU cache or host tier) and runs the
request with them cached. The blocks travel as a disaggregated hand-off's do: exported by the
holder's engine, chunked onto the puller's ``lw.kvx`` subject (real tensors) or waited out over the
planner's predicted link time in the request's first step (a sim engine's modelled KV, as the
offline replay has it), imported by the puller's engine, whose next step announces them in
``KvBlocksStored``. Whatever goes wrong (no answer in time, the holder gone or holding none of
them, a broken payload) costs a recompute, never the request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from bus.blobs import CHUNK_BYTES, send_blob
from bus.client import Bus
from bus.credentials import inbox_prefix, is_inbox
from bus.permissions import Identity
from bus.topology import Subjects
from observability.drops import Drops
from observability.tracing import trace_context
from schemas.codec import decode_as, encode
from schemas.events import KvMove, KvTransferred, RouteDecided
from schemas.messages import KvPullQuery, KvPullReply
from services.engine.protocol import EngineRequest, modelled_kv_move
from services.worker.parts import WorkerParts, WorkerSide
from services.worker.requests import Active, Awaiting

log = logging.getLogger(__name__)
_drops = Drops(log)

# Users whose replies may take KV named for another worker: the cluster's admin (tests, tools).
_ADMIN = Identity("admin").user


def blob_id(request_id: str, attempt: int) -> str:
    """The chunks' id: apart from a hand-off's (the request id) and from other attempts'."""
    return f"{request_id}/{attempt}/move"


class KvMoves(WorkerSide):
    def __init__(self, bus: Bus, parts: WorkerParts, registry: CollectorRegistry) -> None:
        super().__init__(parts)
        self._bus = bus
        self._moves = Counter(
            "laneway_worker_kv_moves",
            "KV moves between workers, by side (pulled: this worker ran the request, sent: it "
            "held the KV) and outcome (ok, failed: the puller recomputed).",
            ["side", "outcome"],
            registry=registry,
        )

    # -- the puller -----------------------------------------------------------------------

    def pull(self, request_id: str, state: Active, event: RouteDecided) -> None:
        """Pull ``event.kv_move``'s blocks, then give the engine the request."""
        move = event.kv_move
        assert move is not None
        span = self._tracer.start_span(
            "worker.kv_move", context=trace.set_span_in_context(state.span)
        )
        span.set_attribute("laneway.source_worker_id", move.source_worker_id)
        span.set_attribute("laneway.blocks", move.blocks)
        # Receiving already: a hand-off's announcement for this request is not awaited.
        state.awaiting = Awaiting(move.source_worker_id, 0, span, receiving=True)
        self._background.spawn(self._pull(request_id, state, move))

    async def _pull(self, request_id: str, state: Active, move: KvMove) -> None:
        started = time.monotonic()
        request = self._requests.engine_request(request_id, state.spec)
        wanted = request.block_hashes[: move.blocks]
        try:
            if not wanted:
                raise ValueError("the prompt has no blocks at this engine's block size")
            sent, data = await self._fetch(request_id, state.spec.attempt, move, wanted)
        except Exception as err:  # any failure to pull costs a recompute, never the request
            source = move.source_worker_id
            log.warning(
                "request %s: KV move from %s failed (%s); recomputing", request_id, source, err
            )
            self._moves.labels("pulled", "failed").inc()
            await self._resume(request_id, state, f"failed: {err}", request)
            return
        hashes = wanted[:sent]
        portable = self._driver.portable
        assert portable is not None  # _fetch refuses an engine that cannot import
        modelled = modelled_kv_move(self._driver.engine) if not data else None
        # Modelled KV: the planner priced the blocks it asked for over the link between the two;
        # the request queues now and its first step waits that out, as offline.
        transfer_ms = move.transfer_ms * sent / len(wanted) if modelled is not None else 0.0

        def adopt() -> bool:
            # An engine op, right before the request is added: its blocks cannot go meanwhile.
            try:
                portable.import_prefix(hashes, data)
            except Exception:  # unusable KV costs a recompute, never the request
                log.exception("KV import of %s's move failed; recomputing", request_id)
                return False
            if modelled is not None:
                modelled.expect_transfer(request_id, transfer_ms)
            return True

        if await self._resume(request_id, state, "pulled", request, adopt):
            self._moves.labels("pulled", "ok").inc()
            self._outputs.kv_transferred(
                KvTransferred(
                    source=self._outputs.source,
                    request_id=request_id,
                    session_id=state.session_id,
                    trace=trace_context(state.span),
                    from_worker_id=move.source_worker_id,
                    to_worker_id=self._outputs.worker_id,
                    block_hashes=hashes,
                    transfer_ms=(time.monotonic() - started + self._receiver.wall_s(transfer_ms))
                    * 1000,
                )
            )

    async def _fetch(
        self, request_id: str, attempt: int, move: KvMove, wanted: tuple[int, ...]
    ) -> tuple[int, bytes]:
        """Ask the holder; how many leading ``wanted`` blocks it sent, and their KV (empty for
        modelled KV)."""
        if self._driver.portable is None:
            raise ValueError("this engine cannot import KV")
        query = KvPullQuery(
            request_id=request_id,
            attempt=attempt,
            to_worker_id=self._outputs.worker_id,
            block_hashes=wanted,
        )
        # The holder answers once its chunks are out: one deadline for both.
        within_s = self._receiver.within_s(move.transfer_ms)
        deadline = time.monotonic() + within_s
        reply = await self._bus.request(Subjects.kv_pull(move.source_worker_id), query, within_s)
        if reply.error is not None or reply.blocks == 0:
            raise ValueError(f"the holder sent nothing: {reply.error}")
        if reply.blocks > len(wanted):
            raise ValueError(f"{reply.blocks} blocks sent for {len(wanted)} asked")
        payload = reply.payload
        if payload is None:
            if modelled_kv_move(self._driver.engine) is None:
                raise ValueError("no KV payload for an engine that computes")
            return reply.blocks, b""
        if payload.chunks != max(1, -(-payload.size // CHUNK_BYTES)):
            raise ValueError(f"{payload.chunks} chunks for {payload.size} bytes")
        left = deadline - time.monotonic()
        data = await self._receiver.blobs.take(blob_id(request_id, attempt), payload, left)
        return reply.blocks, data

    async def _resume(
        self,
        request_id: str,
        state: Active,
        outcome: str,
        request: EngineRequest,
        adopt: Callable[[], bool] | None = None,
    ) -> bool:
        """End the wait and give the engine the request (after ``adopt``, the KV's import);
        False if the request ended or was replaced meanwhile."""
        awaiting, state.awaiting = state.awaiting, None
        if awaiting is not None:
            awaiting.settle(outcome)
        if self._requests.active.get(request_id) is not state:
            return False
        await self._requests.admit(request, adopt)
        return True

    # -- the holder -----------------------------------------------------------------------

    async def on_pull(self, msg: Msg) -> None:
        """Answer a pull for blocks held here: send those it holds, then say how many."""
        try:
            query = decode_as(KvPullQuery, msg.data)
        except (ValidationError, ValueError):
            _drops("malformed_query", "dropping a malformed KV pull")
            return
        if not is_inbox(msg.reply):
            _drops("not_an_inbox", "no KV pull answered to %.80r: not an inbox", msg.reply)
            return
        reply = await self._send(query, msg.reply)
        self._moves.labels("sent", "failed" if reply.blocks == 0 else "ok").inc()
        await msg.respond(encode(reply))

    async def _send(self, query: KvPullQuery, inbox: str) -> KvPullReply:
        portable = self._driver.portable
        if portable is None:
            return KvPullReply(blocks=0, error="this engine cannot export KV")
        try:
            asker = Identity("worker", query.to_worker_id).user
        except ValueError:
            return KvPullReply(blocks=0, error="not a worker id")
        # With bus auth every reply inbox names its user: KV goes only to the worker that asks.
        authed = inbox_prefix("")
        if inbox.startswith(authed) and not any(
            inbox.startswith(inbox_prefix(user) + ".") for user in (asker, _ADMIN)
        ):
            return KvPullReply(blocks=0, error="the asker is not the worker named")
        if len(query.block_hashes) > self._driver.engine.kv_blocks_total:
            return KvPullReply(blocks=0, error="more blocks than this worker's KV holds")
        hashes = query.block_hashes
        try:
            held, data = await self._driver.call(lambda: portable.export_prefix(hashes))
        except Exception as err:  # export is best effort: the asker then recomputes
            log.exception("KV export for a move of %s failed", query.request_id)
            return KvPullReply(blocks=0, error=f"KV export failed: {err}"[:512])
        if held == 0:
            return KvPullReply(blocks=0, error="none of the blocks is held here")
        if not data:
            return KvPullReply(blocks=held)
        subject = Subjects.kv_handoff(query.to_worker_id)
        blob = blob_id(query.request_id, query.attempt)
        payload = await send_blob(self._bus.publish_bytes, subject, blob, data)
        return KvPullReply(blocks=held, payload=payload)
