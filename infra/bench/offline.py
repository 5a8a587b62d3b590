"""Offline replay: a discrete-event simulation in one process, on a simulated clock.

It drives the planner's policy, the kv-indexer's index and the sim engine, unchanged, the way
the live services do: a request arrives, the policy picks a worker from the workers' load and
(if it asks) the index's overlaps, the worker's engine steps, and its KV events fold into the
index when the step ends. Deterministic for a given trace, policy and seed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infra.bench.metrics import (
    ReplayResult,
    RequestRecord,
    WorkerRecord,
    build_report,
    busy_timeline,
)
from infra.bench.traces import PromptFactory, TraceRequest
from schemas.events import SamplingParams
from services.engine.kv_events import kv_event
from services.engine.protocol import EngineRequest, KvChange, StepResult
from services.engine.sim import SimConfig, SimEngine, timing_preset
from services.kv_indexer.index import PrefixIndex
from services.planner.policy import Choice, Policy, RouteRequest, WorkerView

_ARRIVAL, _STEP_END = 0, 1


@dataclass
class _Worker:
    worker_id: str
    engine: SimEngine
    record: WorkerRecord
    in_flight: int = 0
    stepping: bool = False
    kv_seq: int = 0


def decision_record(request_id: str, choice: Choice, views: Sequence[WorkerView]) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "worker_id": choice.worker_id,
        "reason": choice.reason,
        "candidates": [
            {
                "worker_id": v.worker_id,
                "cached_blocks": v.cached_blocks,
                "running": v.running,
                "waiting_prefill_tokens": v.waiting_prefill_tokens,
                "kv_usage": round(v.kv_usage, 4),
                "predicted_queue_ms": choice.predictions.get(v.worker_id, (None, None))[0],
                "predicted_prefill_ms": choice.predictions.get(v.worker_id, (None, None))[1],
                "cost": choice.scores[v.worker_id],
            }
            for v in views
        ],
    }


class OfflineReplay:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        workers: int,
        config: SimConfig,
    ) -> None:
        self._trace = trace
        self._policy = policy
        self._config = config
        self._prompts = PromptFactory(config.block_size)
        timing = timing_preset(config.timing)
        self._workers = [
            _Worker(f"w{i:03d}", SimEngine(config, timing), WorkerRecord()) for i in range(workers)
        ]
        self._index = PrefixIndex()
        self._records = [RequestRecord(r.arrival_s, r.input_length) for r in trace]
        self._owner: dict[str, int] = {}
        self._events: list[tuple[float, int, int, int, Any]] = []
        # Every routing decision with its inputs, when asked for (`laneway bench --decisions`).
        self.decisions: list[dict[str, Any]] | None = None
        self._seq = 0

    def _push(self, at: float, kind: int, who: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, who, payload))

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        for i, request in enumerate(self._trace):
            self._push(request.arrival_s, _ARRIVAL, i)
        now = 0.0
        while self._events:
            now, _, kind, who, payload = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._arrive(now, who)
            else:
                self._step_end(now, self._workers[who], who, payload)
        records = {w.worker_id: w.record for w in self._workers}
        report = build_report(self._records, records, time.perf_counter() - started)
        report["busy_timeline"] = busy_timeline(records, report["duration_s"])
        return ReplayResult(report, self._records, self.decisions or ())

    def _arrive(self, now: float, i: int) -> None:
        request = self._trace[i]
        hashes = self._prompts.block_hashes(request)
        request_id = f"r{i}"
        route = RouteRequest(
            request_id, request.input_length, hashes, max_tokens=request.output_length
        )
        overlaps = self._index.overlaps(hashes) if self._policy.wants_overlap(route) else {}
        views = []
        for worker in self._workers:
            load = worker.engine.load()
            views.append(
                WorkerView(
                    worker_id=worker.worker_id,
                    running=load.running,
                    waiting=load.waiting,
                    kv_usage=load.kv_blocks_used / load.kv_blocks_total,
                    in_flight=worker.in_flight,
                    cached_blocks=overlaps.get(worker.worker_id, 0),
                    waiting_prefill_tokens=load.waiting_prefill_tokens,
                    block_size=worker.engine.block_size,
                    kv_capacity_tokens=load.kv_blocks_total * worker.engine.block_size,
                )
            )
        choice = self._policy.choose(route, views)
        if self.decisions is not None:
            self.decisions.append(decision_record(request_id, choice, views))
        w = next(k for k, v in enumerate(self._workers) if v.worker_id == choice.worker_id)
        worker = self._workers[w]
        record = self._records[i]
        record.worker_id = worker.worker_id
        worker.record.requests += 1
        try:
            worker.engine.add_request(
                EngineRequest(
                    request_id,
                    self._prompts.prompt(request),
                    SamplingParams(max_tokens=request.output_length, ignore_eos=True),
                    hashes,
                )
            )
        except ValueError:  # larger than the worker's whole KV cache
            record.failed = True
            return
        self._owner[request_id] = i
        worker.in_flight += 1
        if not worker.stepping:
            self._start_step(now, worker, w)

    def _start_step(self, now: float, worker: _Worker, w: int) -> None:
        result = worker.engine.step()
        if result.duration_s <= 0 and not result.outputs:
            self._fold(worker, result.kv_changes)
            worker.stepping = False  # nothing could be scheduled: wait for the next arrival
            return
        worker.stepping = True
        worker.record.busy.append((now, now + result.duration_s))
        self._push(now + result.duration_s, _STEP_END, w, result)

    def _step_end(self, now: float, worker: _Worker, w: int, result: StepResult) -> None:
        # A live worker publishes a step's KV events when the step is done; so does this.
        self._fold(worker, result.kv_changes)
        for output in result.outputs:
            record = self._records[self._owner[output.request_id]]
            if record.first_token_s is None:
                record.first_token_s = now
                record.cached_tokens = output.cached_tokens or 0
            record.output_tokens += len(output.new_token_ids)
            record.last_token_s = now
            if output.finished:
                del self._owner[output.request_id]
                worker.in_flight -= 1
        worker.stepping = False
        if worker.engine.has_work():
            self._start_step(now, worker, w)

    def _fold(self, worker: _Worker, changes: list[KvChange]) -> None:
        for change in changes:
            worker.kv_seq += 1
            self._index.apply(kv_event(change, worker.worker_id, worker.kv_seq))
