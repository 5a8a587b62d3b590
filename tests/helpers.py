"""Helpers shared by tests of every component."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, overload

from schemas.events import (
    KvBlocksStored,
    KvChanged,
    RequestSpec,
    Role,
    RouteDecided,
    StoredRun,
    WorkerLoadReported,
)
from schemas.messages import WorkerRegistration

T = TypeVar("T")


def routed(request_id: str, worker_id: str, spec: RequestSpec, **fields: Any) -> RouteDecided:
    """A planner's decision to run ``spec`` on ``worker_id``, as a worker receives it."""
    return RouteDecided(
        source="test",
        request_id=request_id,
        worker_id=worker_id,
        policy="test",
        reason="test",
        candidates=(),
        spec=spec,
        **fields,
    )


def registration(worker_id: str, max_model_len: int | None = None) -> WorkerRegistration:
    """A small sim worker's record, as etcd holds it (``max_model_len`` None: one registered
    before workers declared their context limit)."""
    return WorkerRegistration(
        worker_id=worker_id,
        role="both",
        engine="sim",
        model="m",
        block_size=16,
        kv_blocks_total=10,
        max_num_seqs=4,
        max_model_len=max_model_len,
        pid=1,
    )


@overload
async def eventually(
    predicate: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = ...,
    interval: float = ...,
    message: str = ...,
) -> T: ...
@overload
async def eventually(
    predicate: Callable[[], T | None],
    *,
    timeout: float = ...,
    interval: float = ...,
    message: str = ...,
) -> T: ...
async def eventually(
    predicate: Callable[[], Any],
    *,
    timeout: float = 5.0,
    interval: float = 0.05,
    message: str = "the condition never held",
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy, and return that.

    For what other processes or tasks do in their own time (events in flight, leases expiring).
    On timeout the AssertionError carries the last value, so a failure says what was seen."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = predicate()
        value = await result if inspect.isawaitable(result) else result
        if value:
            return value
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"{message} within {timeout}s; last value: {value!r}")
        await asyncio.sleep(interval)


def load_report(
    worker_id: str, running: int = 0, waiting: int = 0, role: Role = "both"
) -> WorkerLoadReported:
    """A worker's load report of ``running`` and ``waiting`` requests, its KV nearly empty."""
    return WorkerLoadReported(
        source=f"worker/{worker_id}",
        worker_id=worker_id,
        role=role,
        running=running,
        waiting=waiting,
        waiting_prefill_tokens=0,
        kv_blocks_used=0,
        kv_blocks_total=10,
    )


def stored_blocks(events: Iterable[object], worker_id: str) -> list[int]:
    """The block hashes ``worker_id``'s KV events among ``events`` said it stored, in order."""
    stored: list[int] = []
    for event in events:
        if isinstance(event, KvChanged) and event.worker_id == worker_id:
            for change in event.changes:
                if isinstance(change, StoredRun):
                    stored += change.block_hashes
        elif isinstance(event, KvBlocksStored) and event.worker_id == worker_id:
            stored += event.block_hashes
    return stored
