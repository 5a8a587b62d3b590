"""Everything a worker publishes about its requests, its KV and its load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine

from nats.aio.msg import Msg
from pydantic import ValidationError

from bus.client import Bus
from bus.credentials import is_inbox
from bus.topology import Subjects
from observability.drops import Drops, RateLimitedLog
from schemas.codec import decode_as, encode
from schemas.control_events import StepCost
from schemas.events import (
    KvTransferred,
    RequestSpec,
    Role,
    TerminalEvent,
    TokenBatch,
    TokenRun,
    WorkerLoadReported,
)
from schemas.kv_events import MAX_KV_CHANGES
from schemas.messages import ResendQuery
from schemas.trusted import trusted
from services.engine.kv_events import coalesced, continued, kv_changed
from services.engine.protocol import EngineLoad, KvChange
from services.worker.stream import Chunk
from services.worker.token_log import TokenLog

log = logging.getLogger(__name__)
_drops = Drops(log)
_failures = RateLimitedLog(log)


class Background:
    """Tasks a worker does not wait for where it starts them, but does when it stops."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # Each failed once per thing it did (a terminal the stream never took, a send to a
        # gone worker): another worker flooding a stream can fail many, so the log is bounded.
        error = task.exception()
        _failures.warning(type(error).__name__, "background work failed: %r", error)

    async def finish(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Outputs:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        background: Background,
        token_interval_s: float = 0.0,
        kv_interval_s: float = 0.0,
    ) -> None:
        self._bus = bus
        self.worker_id = worker_id
        self.source = f"worker/{worker_id}"
        self._background = background
        # Steps faster than a message's cost to the bus and the ingress (a sim at a high
        # speed-up, a small model): a step's tokens wait for the next step's while its ingress
        # had a batch less than this long ago. A slower engine's steps each go out at their end.
        self._token_interval_s = token_interval_s
        self._batch_sent: dict[str, float] = {}  # by ingress, within the interval
        self._urgent: set[str] = set()  # ingresses a request's first tokens go to
        self._held: dict[str, list[TokenRun]] = {}  # by ingress, for the next step's batch
        self._kv_seq = 0
        # A step's KV changes wait this long at most for later steps' to go in one event.
        self._kv_interval_s = kv_interval_s
        # The last step's KV changes, out with the next step's (see :meth:`kv`), and those of
        # earlier steps waiting for the KV interval to pass since the first of them was due.
        self._held_kv: list[KvChange] = []
        self._due_kv: list[KvChange] = []
        self._kv_due_since = 0.0
        self.kept = TokenLog(self.source, worker_id)
        # Queued since the last flush: token runs by ingress, then terminals (with their
        # ingress), in the order they came.
        self._runs: dict[str, list[TokenRun]] = {}
        self._terminals: list[tuple[str, TerminalEvent]] = []
        self._flush_queued = False

    def tokens(self, spec: RequestSpec, request_id: str, chunk: Chunk) -> None:
        """Queue a request's new tokens for the step's batch to its ingress (:meth:`flush`)."""
        # Of a validated route and the engine's own tokens: nothing a validation would refuse.
        run = trusted(TokenRun, {
            "request_id": request_id, "attempt": spec.attempt, "index": chunk.position,
            "token_ids": chunk.token_ids, "text": chunk.text, "logprobs": chunk.logprobs,
        })  # fmt: skip
        self.kept.published(run)
        runs = self._runs.get(spec.reply_to)
        if runs is None:
            runs = self._runs[spec.reply_to] = []
        runs.append(run)
        if chunk.position == spec.sampling.offset:  # what its client waits for: its TTFT
            self._urgent.add(spec.reply_to)
        self._flush_soon()

    async def flush(self, step_end: bool = False) -> None:
        """Publish what was queued: one batch per ingress, then the terminals, queued on the
        connection behind them (so a terminal comes after its request's last tokens), all in
        one write with whatever was published since the last. At a step's end (``step_end``)
        an ingress sent a batch less than the token interval ago waits for the next step's,
        unless a request's first tokens or a terminal go to it."""
        terminals, self._terminals = self._terminals, []
        runs = self._due(step_end, {reply_to for reply_to, _ in terminals})
        for reply_to, queued in runs.items():
            batch = TokenBatch(source=self.source, worker_id=self.worker_id, runs=tuple(queued))
            await self._bus.publish(Subjects.tokens(reply_to, self.worker_id), batch)
        for reply_to, event in terminals:
            subject = Subjects.request_terminal(reply_to, self.worker_id)
            # Sent now; its stream's confirmation, awaited here, would stall every other
            # request's next step. A try not confirmed at once goes on in the background.
            await self._bus.send_confirmed(subject, event, self._background.spawn)
        if runs or terminals:
            # The connection writes from a task of its own: let it, before an engine stepped on
            # this thread computes the next step (the batches would wait that long).
            await asyncio.sleep(0)

    def _due(self, step_end: bool, ending: set[str]) -> dict[str, list[TokenRun]]:
        """The runs to publish now, by ingress, taken from the queue; the rest held."""
        queued = self._held  # earlier steps' runs first
        for reply_to, runs in self._runs.items():
            queued.setdefault(reply_to, []).extend(runs)
        self._runs, self._held = {}, {}
        urgent, self._urgent = self._urgent, set()
        if not self._token_interval_s:
            return queued
        now = asyncio.get_running_loop().time()
        interval = self._token_interval_s
        sent = {r: at for r, at in self._batch_sent.items() if now - at < interval}
        at_once = urgent | ending
        due: dict[str, list[TokenRun]] = {}
        for reply_to, runs in queued.items():
            held = step_end and reply_to in sent and reply_to not in at_once
            (self._held if held else due)[reply_to] = runs
        self._batch_sent = {**sent, **dict.fromkeys(due, now)}
        return due

    def _flush_soon(self) -> None:
        """Outputs of no engine step (a hand-off's first token, a cancellation) go out once the
        event loop is free; a step's go with :meth:`flush` at its end, before that."""
        if not self._flush_queued:
            self._flush_queued = True
            asyncio.get_running_loop().call_soon(self._flush_queued_outputs)

    def _flush_queued_outputs(self) -> None:
        self._flush_queued = False
        if self._runs or self._terminals:
            self._background.spawn(self.flush())

    async def on_resend(self, msg: Msg) -> None:
        """Answer a resend query for a request held here (asked of the worker the planner placed
        it on); one for a request not held stays unanswered."""
        try:
            query = decode_as(ResendQuery, msg.data)
        except (ValidationError, ValueError):
            _drops("malformed_query", "dropping a malformed resend query")
            return
        self.kept.expire(time.monotonic())
        reply = self.kept.reply(query.request_id, query.index, query.attempt)
        if reply is not None and is_inbox(msg.reply):
            await msg.respond(encode(reply))

    def terminal(self, reply_to: str, event: TerminalEvent) -> None:
        self.kept.ended(event, time.monotonic())
        self._terminals.append((reply_to, event))
        self._flush_soon()

    def kv_transferred(self, event: KvTransferred) -> None:
        self._background.spawn(self._bus.publish(Subjects.kv_transferred(self.worker_id), event))

    async def kv(self, changes: list[KvChange]) -> None:
        """Publish a step's KV changes one step late, so that a run the next step continues
        goes with it (a prompt's blocks and the block its first generated token completes),
        and with the changes of the steps after it until the KV interval has passed since the
        first of them was due: one event for them all, a stored message that the kv-indexer
        and every planner fold (and that wakes them). What is held goes out when the engine
        runs out of work (:meth:`idle`): a request served alone is folded after its last step,
        not during it, where the folds would take a core from its tokens."""
        out, self._held_kv = continued(self._held_kv, coalesced(changes))
        now = asyncio.get_running_loop().time()
        if out and not self._due_kv:
            self._kv_due_since = now
        self._due_kv += out
        if self._due_kv and now - self._kv_due_since >= self._kv_interval_s:
            await self._publish_kv()

    async def idle(self) -> None:
        """The engine ran out of work: what was held for its next steps goes now."""
        self._due_kv += self._held_kv
        self._held_kv = []
        if self._due_kv:
            await self._publish_kv()
        if self._held:
            await self.flush()

    async def _publish_kv(self) -> None:
        """The changes due, in their order, in as few events as hold them."""
        changes, self._due_kv = coalesced(self._due_kv), []
        # Per-worker order is what the index needs; one connection preserves it.
        for start in range(0, len(changes), MAX_KV_CHANGES):
            self._kv_seq += 1
            part = changes[start : start + MAX_KV_CHANGES]
            event = kv_changed(part, self.worker_id, self._kv_seq)
            await self._bus.publish(Subjects.kv(self.worker_id), event)

    async def load(
        self, role: Role, load: EngineLoad, busy_s: float, step_cost: StepCost | None = None
    ) -> None:
        await self._bus.publish(
            Subjects.load(self.worker_id),
            WorkerLoadReported(
                source=self.source,
                worker_id=self.worker_id,
                role=role,
                running=load.running,
                waiting=load.waiting,
                waiting_prefill_tokens=load.waiting_prefill_tokens,
                kv_blocks_used=load.kv_blocks_used,
                kv_blocks_total=load.kv_blocks_total,
                busy_s=busy_s,
                step_cost=step_cost,
                loras=load.loras,
            ),
        )
