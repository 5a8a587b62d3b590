"""Live replay: the trace through the real services, as streamed OpenAI completions.

Arrivals keep the trace's timestamps. ``time_scale`` compresses the whole replay (arrival gaps
and the workers' modelled step times alike) so that an hour of traffic fits a short run; the
measured times are scaled back, so the figures compare with an offline replay of the same trace.
A real engine's steps take real time: with one, ``time_scale`` stays 1.

Prompts go as text, which the sim's byte tokenizer maps back to the trace's tokens, or, for a
model with a tokenizer of its own (``token_ids``), as those tokens' ids. The cached tokens are
the engine's own count (``usage.prompt_tokens_details.cached_tokens``); beside them the report
gives what the planner's index said the chosen worker held, the input of its routing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from bus.client import Bus
from bus.topology import Subjects
from infra.bench.load_client import stream_one
from infra.bench.metrics import (
    PoolUsage,
    ReplayResult,
    RequestRecord,
    WorkerRecord,
    build_report,
)
from infra.bench.traces import PromptFactory, TraceRequest
from schemas.events import (
    Event,
    RequestFinished,
    Role,
    RolesRebalanced,
    RouteDecided,
    WorkerLoadReported,
)
from schemas.latency import LatencyHistogram


class _ClusterObserver:
    """Which worker served each request, how busy each worker was and in which role, and how the
    capacity loop moved them, from the bus."""

    def __init__(self, time_scale: float) -> None:
        self.routes: dict[str, str] = {}
        self.decisions: list[dict[str, Any]] = []
        self.busy_start: dict[str, float] = {}
        self.busy_now: dict[str, float] = {}
        self.roles: dict[str, Role] = {}
        self.roles_timeline: list[dict[str, Any]] = []
        self.pools = PoolUsage()
        # Token gaps as the workers saw them, before the trip to the client.
        self.worker_gaps = LatencyHistogram()
        # Each worker's last load report: when it came (monotonic) and its busy seconds.
        self._reported: dict[str, tuple[float, float]] = {}
        self.remote_prefills = 0
        self._time_scale = time_scale
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._record_roles("start")

    async def on_event(self, event: Event) -> None:
        # A remote prefill's decision also goes to the prefill worker: count it once.
        if isinstance(event, RouteDecided) and event.request_id not in (None, *self.routes):
            assert event.request_id is not None
            self.routes[event.request_id] = event.worker_id
            self.decisions.append(event.model_dump(mode="json", exclude={"spec"}))
            if event.prefill is not None and event.prefill.prefill_worker_id is not None:
                self.remote_prefills += 1
        elif isinstance(event, WorkerLoadReported):
            self.busy_start.setdefault(event.worker_id, event.busy_s)
            self.busy_now[event.worker_id] = event.busy_s
            now = time.monotonic()
            last = self._reported.get(event.worker_id)
            if last is not None:  # the time since its last report, in the role it reports now
                self.pools.add(event.role, now - last[0], event.busy_s - last[1])
            self._reported[event.worker_id] = (now, event.busy_s)
            if self.roles.get(event.worker_id, event.role) != event.role:
                self.roles[event.worker_id] = event.role
                self._record_roles(f"{event.worker_id} is now {event.role}")
            self.roles[event.worker_id] = event.role
        elif isinstance(event, RolesRebalanced):
            self._record_roles(event.reason)
        elif isinstance(event, RequestFinished):
            self.worker_gaps.merge(event.token_gaps)

    def _record_roles(self, reason: str) -> None:
        roles = list(self.roles.values())
        self.roles_timeline.append(
            {
                "t": round((time.monotonic() - self._t0) * self._time_scale, 3),
                "prefill": roles.count("prefill"),
                "decode": len(roles) - roles.count("prefill"),
                "reason": reason,
            }
        )


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    record: RequestRecord,
    at: Callable[[float], float],
    errors: Counter[str],
) -> tuple[str | None, int]:
    """The request's id as the ingress named it, and how many chunks carried its text; its
    tokens' times go into ``record`` as ``at`` turns the client's clock into the replay's."""
    sample = await stream_one(session, url, body, headers, timeout_s)
    for when in sample.chunk_times:
        record.times.came(at(when))
    record.output_tokens = len(sample.chunk_times)
    usage = sample.usage or {}
    if "completion_tokens" in usage:
        record.output_tokens = usage["completion_tokens"]
        # The prompt as the engine counted it (the trace's length, unless a tokenizer differs).
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens") or 0
    record.failed = sample.error is not None
    if sample.error is not None:
        errors[sample.error[:80]] += 1
    request_id = None if sample.response_id is None else sample.response_id.removeprefix("cmpl-")
    return request_id, len(sample.chunk_times)


def _cached_tokens(
    records: Sequence[RequestRecord],
    answers: Sequence[tuple[str | None, int]],
    decisions: Sequence[dict[str, Any]],
) -> dict[str, int]:
    """Over the completed requests: their prompt tokens, those the engine found cached, and those
    the planner's index said the chosen worker held (its blocks at the worker's block size; 0
    under a policy that never asks the index: round robin, random, least loaded). An engine that
    finds far fewer than the index promised holds blocks other than those it reported, or
    evicted them after; a few fewer are its own rule (vLLM computes at least a prompt's last
    token, so a prompt cached whole gives up its last block)."""
    promised: dict[str, int] = {}
    for decision in decisions:
        for candidate in decision["candidates"]:
            if candidate["worker_id"] == decision["worker_id"]:
                promised[decision["request_id"]] = (
                    candidate["cached_blocks"] * candidate["block_size"]
                )
    done = [(r, a[0]) for r, a in zip(records, answers, strict=True) if r.done]
    return {
        "prompt_tokens": sum(r.prompt_tokens for r, _ in done),
        "cached_tokens": sum(r.cached_tokens for r, _ in done),
        "index_cached_tokens": sum(promised.get(i or "", 0) for _, i in done),
    }


async def replay_live(
    trace: Sequence[TraceRequest],
    base_url: str,
    nats_url: str,
    model: str,
    block_size: int,
    time_scale: float = 1.0,
    timeout_s: float = 3600.0,
    progress: Callable[[int], None] | None = None,
    headers: dict[str, str] | None = None,
    token_ids: bool = False,
) -> ReplayResult:
    """``progress``, if given, is called with the number of requests finished so far;
    ``headers`` go on every request (the cluster's API key: ``LocalCluster.api_headers``);
    ``token_ids``: prompts as token ids, not text."""
    prompts = PromptFactory(block_size)
    texts: list[str | list[int]] = [
        prompts.prompt(r).token_ids() if token_ids else prompts.prompt(r).text() for r in trace
    ]
    records = [RequestRecord(r.arrival_s, r.input_length) for r in trace]
    observer = _ClusterObserver(time_scale)
    bus = await Bus.connect(nats_url, "laneway-bench")
    await bus.subscribe(Subjects.all_routes, observer.on_event)
    await bus.subscribe(Subjects.all_load, observer.on_event)
    await bus.subscribe(Subjects.roles_rebalanced, observer.on_event)
    await bus.subscribe(Subjects.all_request_terminals, observer.on_event)
    await asyncio.sleep(1.0)  # a first load report from every worker, for the busy baseline
    observer.start()
    started = time.perf_counter()
    answers: list[tuple[str | None, int]] = []
    errors: Counter[str] = Counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        finished = 0
        if progress is not None:
            progress(finished)  # after the cluster's start-up: the ETA counts the replay alone

        def at(when: float) -> float:
            return (when - t0) * time_scale

        async def fire(i: int) -> tuple[str | None, int]:
            nonlocal finished
            delay = trace[i].arrival_s / time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": model,
                "prompt": texts[i],
                "max_tokens": trace[i].output_length,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            url = f"{base_url}/completions"
            answer = await _one(
                session, url, body, headers or {}, timeout_s, records[i], at, errors
            )
            finished += 1
            if progress is not None:
                progress(finished)
            return answer

        answers = list(await asyncio.gather(*(fire(i) for i in range(len(trace)))))
    await asyncio.sleep(1.5)  # the workers' last load reports
    await bus.close()
    workers: dict[str, WorkerRecord] = {}
    for worker_id, busy in observer.busy_now.items():
        record = WorkerRecord()
        # The workers report real seconds; scaled back like every other time here.
        spent = (busy - observer.busy_start.get(worker_id, 0.0)) * time_scale
        record.busy.append((0.0, spent))
        workers[worker_id] = record
    for (request_id, _), rec in zip(answers, records, strict=True):
        served_by = observer.routes.get(request_id or "")
        if served_by is not None:
            rec.worker_id = served_by
            workers.setdefault(served_by, WorkerRecord()).requests += 1
    extra: dict[str, Any] = {"time_scale": time_scale}
    # The client's ITL counts streamed chunks and everything between worker and client; the
    # workers' own count tells the engine's share apart.
    worker_itl = {f"p{q}": observer.worker_gaps.percentile(q) for q in (50, 95, 99)}
    extra["worker_itl_ms"] = {k: v * time_scale for k, v in worker_itl.items() if v is not None}
    # The client's gaps are between chunks: a chunk carrying several tokens is one gap.
    chunks = sum(n for r, (_, n) in zip(records, answers, strict=True) if r.done)
    tokens = sum(r.output_tokens for r in records if r.done)
    extra["tokens_per_chunk"] = tokens / chunks if chunks else None
    # Why the failed ones failed, as the client saw it.
    extra["client_errors"] = dict(errors)
    extra.update(_cached_tokens(records, answers, observer.decisions))
    report = build_report(records, workers, time.perf_counter() - started, extra)
    pools = observer.pools.fractions()
    if "prefill" in pools:
        report["pool_busy_fraction"] = pools
        report["remote_prefills"] = observer.remote_prefills
        if len(observer.roles_timeline) > 1:
            report["roles_timeline"] = observer.roles_timeline
    return ReplayResult(report, records, observer.decisions)
