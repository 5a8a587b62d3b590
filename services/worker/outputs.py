"""Everything a worker publishes about its requests, its KV and its load."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine

from nats.aio.msg import Msg
from pydantic import ValidationError

from bus.client import Bus
from bus.topology import Subjects
from schemas.codec import decode_as, encode
from schemas.events import (
    KvTransferred,
    RequestSpec,
    Role,
    TerminalEvent,
    TokensGenerated,
    WorkerLoadReported,
)
from schemas.messages import ResendQuery
from services.engine.kv_events import kv_event
from services.engine.protocol import EngineLoad, KvChange
from services.worker.stream import Chunk
from services.worker.token_log import TokenLog

log = logging.getLogger(__name__)


class Background:
    """Tasks a worker does not wait for where it starts them, but does when it stops."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, work: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def finish(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Outputs:
    def __init__(self, bus: Bus, worker_id: str, background: Background) -> None:
        self._bus = bus
        self.worker_id = worker_id
        self.source = f"worker/{worker_id}"
        self._background = background
        self._kv_seq = 0
        self.kept = TokenLog()

    async def tokens(
        self, spec: RequestSpec, request_id: str, session_id: str | None, chunk: Chunk
    ) -> None:
        batch = TokensGenerated(
            source=self.source,
            request_id=request_id,
            session_id=session_id,
            worker_id=self.worker_id,
            index=chunk.position,
            token_ids=chunk.token_ids,
            text=chunk.text,
            attempt=spec.attempt,
        )
        self.kept.published(batch)
        await self._bus.publish(Subjects.tokens(spec.reply_to, self.worker_id), batch)

    async def on_resend(self, msg: Msg) -> None:
        """Answer a resend query for a request held here (asked of the worker the planner placed
        it on); one for a request not held stays unanswered."""
        try:
            query = decode_as(ResendQuery, msg.data)
        except (ValidationError, ValueError):
            log.warning("dropping a malformed resend query")
            return
        self.kept.expire(time.monotonic())
        reply = self.kept.reply(query.request_id, query.index, query.attempt)
        if reply is not None and msg.reply:
            await msg.respond(encode(reply))

    def terminal(self, reply_to: str, event: TerminalEvent) -> None:
        self.kept.ended(event, time.monotonic())
        # Awaiting the stream's confirmation here would stall every other request's next step;
        # the publish is queued on the connection behind this request's token deltas, so order
        # holds.
        subject = Subjects.request_terminal(reply_to, self.worker_id)
        self._background.spawn(self._bus.publish(subject, event))

    def kv_transferred(self, event: KvTransferred) -> None:
        self._background.spawn(self._bus.publish(Subjects.kv_transferred(self.worker_id), event))

    async def kv(self, changes: list[KvChange]) -> None:
        subject = Subjects.kv(self.worker_id)
        for change in changes:
            self._kv_seq += 1
            # Per-worker order is what the index needs; one connection preserves it.
            await self._bus.publish(subject, kv_event(change, self.worker_id, self._kv_seq))

    async def load(self, role: Role, load: EngineLoad, busy_s: float) -> None:
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
            ),
        )
