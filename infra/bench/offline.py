"""Offline replay: a discrete-event simulation in one process, on a simulated clock.

It drives the planner's policy, the kv-indexer's index and the sim engine, unchanged, the way
the live services do: a request arrives, the policy picks a worker from the workers' load and
(if it asks) the index's overlaps, the worker's engine steps, and its KV events fold into the
index when the step ends. Deterministic for a given trace, policy and seed.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter

from infra.bench.metrics import (
    PoolUsage,
    ReplayResult,
    RequestRecord,
    WorkerRecord,
    build_report,
    busy_timeline,
)
from infra.bench.traces import PromptFactory, TraceRequest
from schemas.events import Role, SamplingParams
from schemas.latency import LatencyHistogram
from services.engine.continuation import Continuation, continuation, handoff_tokens
from services.engine.kv_events import kv_event
from services.engine.protocol import EngineRequest, KvChange, RequestOutput, StepResult
from services.engine.sim import SimConfig, SimEngine, perf_model
from services.kv_indexer.index import PrefixIndex
from services.planner.capacity import (
    CapacityPlanner,
    CapacitySettings,
    observe_interval,
    workers_to_move,
)
from services.planner.decision import Decision, DecisionInputs, decide
from services.planner.disagg import DisaggSettings
from services.planner.kv_policy import KvAware
from services.planner.policy import Policy, RouteRequest, WorkerView
from services.worker.stream import RequestStream

_ARRIVAL, _STEP_END, _KV_ARRIVED, _PLAN = 0, 1, 2, 3
_FIELDS: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])
# Arrivals between two calls of the progress callback: off the per-event path.
_PROGRESS_EVERY = 64
# Suffix of the id a request has on the prefill worker that computes its prompt.
_PREFILL = "/prefill"


@dataclass
class _Worker:
    worker_id: str
    engine: SimEngine
    record: WorkerRecord
    role: Role = "both"
    # The role it moves to once its in-flight work is done (the capacity loop moved it).
    next_role: Role | None = None
    # Requests its engine holds (a prefill worker's included): it switches roles at none.
    in_flight: int = 0
    # Requests routed to it to decode that have not ended, its KV wait included: what the live
    # planner counts in flight there.
    routed: int = 0
    stepping: bool = False
    kv_seq: int = 0
    # Since when it has served in `role`, and its busy seconds since.
    role_since: float = 0.0
    busy_in_role: float = 0.0


def decision_record(request_id: str, decision: Decision) -> dict[str, Any]:
    """A decision as ``laneway bench --decisions`` writes it: the fields live ``RouteDecided``
    events carry, named alike."""
    return {"request_id": request_id, **_FIELDS.dump_python(decision.route_fields(), mode="json")}


class OfflineReplay:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        workers: int,
        config: SimConfig,
        prefill_workers: int = 0,
        disagg: DisaggSettings | None = None,
        autoscale: CapacitySettings | None = None,
    ) -> None:
        """``workers`` serve requests end to end (role ``both``), or decode only when
        ``prefill_workers`` (role ``prefill``) are added beside them."""
        self._trace = trace
        self._policy = policy
        self._config = config
        self._prompts = PromptFactory(config.block_size)
        perf = perf_model(config.perf_model)
        self._workers = [
            _Worker(f"p{i:03d}", SimEngine(config, perf), WorkerRecord(), "prefill")
            for i in range(prefill_workers)
        ]
        self._workers += [
            _Worker(
                f"w{i:03d}",
                SimEngine(config, perf),
                WorkerRecord(),
                "decode" if prefill_workers else "both",
            )
            for i in range(workers)
        ]
        self._disagg = disagg or DisaggSettings(mode="never")
        self._capacity = CapacityPlanner(autoscale) if autoscale else None
        self._roles_timeline: list[dict[str, Any]] = []
        self._pools = PoolUsage()
        if (prefill_workers or autoscale) and not isinstance(policy, KvAware):
            raise ValueError("disaggregation needs the kv policy's cost model")
        self._index = PrefixIndex()
        self._records = [RequestRecord(r.arrival_s, r.input_length) for r in trace]
        # Each request's output as its live worker streams it (times, gaps), while it runs.
        self._streams: dict[int, RequestStream] = {}
        # Token gaps since the capacity loop last looked, bucketed as the live loop gets them,
        # and how many of them waited on a prefill in the same step.
        self._interval_gaps = LatencyHistogram()
        self._interval_stalled = 0
        self._owner: dict[str, int] = {}
        self._events: list[tuple[float, int, int, int, Any]] = []
        # Every routing decision with its inputs, when asked for (`laneway bench --decisions`).
        self.decisions: list[tuple[DecisionInputs, Decision]] | None = None
        # Called with the arrivals so far, now and then (`laneway bench`'s progress).
        self.progress: Callable[[int], None] | None = None
        # Every sim engine can hand a prompt's KV over.
        self._handoff = frozenset(w.worker_id for w in self._workers)
        self._seq = 0
        self._remote_prefills = 0
        # Decode-side state of requests whose prompt a prefill worker is computing.
        self._handoffs: dict[int, tuple[int, EngineRequest, int]] = {}

    def _push(self, at: float, kind: int, who: int, payload: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, who, payload))

    def run(self) -> ReplayResult:
        started = time.perf_counter()
        for i, request in enumerate(self._trace):
            self._push(request.arrival_s, _ARRIVAL, i)
        if self._capacity is not None:
            self._record_roles(0.0, "start")
            self._push(self._capacity.settings.interval_s, _PLAN, 0)
        now = 0.0
        while self._events:
            now, _, kind, who, payload = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._arrive(now, who)
                if self.progress is not None and who % _PROGRESS_EVERY == 0:
                    self.progress(who)
            elif kind == _STEP_END:
                self._step_end(now, self._workers[who], who, payload)
            elif kind == _KV_ARRIVED:
                self._kv_arrived(now, who, payload)
            elif len(self._events) > 0:  # plan while there is traffic left
                self._plan(now)
        records = {w.worker_id: w.record for w in self._workers}
        report = build_report(self._records, records, time.perf_counter() - started)
        report["busy_timeline"] = busy_timeline(records, report["duration_s"])
        for worker in self._workers:
            self._close_role(now, worker)
        report["pool_busy_fraction"] = self._pools.fractions()
        report["remote_prefills"] = self._remote_prefills
        if self._capacity is not None:
            report["roles_timeline"] = self._roles_timeline
        decisions = [decision_record(i.request.request_id, d) for i, d in self.decisions or ()]
        return ReplayResult(report, self._records, decisions)

    def _arrive(self, now: float, i: int) -> None:
        request = self._trace[i]
        hashes = self._prompts.block_hashes(request)
        request_id = f"r{i}"
        self._streams[i] = RequestStream(request.input_length, request.arrival_s, histogram=False)
        route = RouteRequest(
            request_id, request.input_length, hashes, max_tokens=request.output_length
        )
        overlaps = {}
        if hashes and self._policy.wants_overlap(route):
            overlaps = self._index.overlaps(hashes)
        inputs = DecisionInputs(
            route,
            [self._view(w, overlaps) for w in self._pool("decode")],
            [self._view(w, overlaps) for w in self._pool("prefill")],
            self._handoff,
        )
        decision = decide(self._policy, self._disagg, inputs)
        if self.decisions is not None:
            self.decisions.append((inputs, decision))
        w = self._accept(i, decision.worker_id)
        remote = decision.prefill_worker_id
        sampling = SamplingParams(max_tokens=request.output_length, ignore_eos=True)
        whole = EngineRequest(request_id, self._prompts.prompt(request), sampling, hashes)
        if remote is None:
            self._submit(now, w, i, whole)
            return
        self._remote_prefills += 1
        self._records[i].prefill_worker_id = remote
        # The decode worker's KV of the prompt when the planner decided, as a live one counts it.
        cached = next(v.cached_blocks for v in inputs.decoders if v.worker_id == decision.worker_id)
        self._handoffs[i] = (w, whole, cached)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        prefill = EngineRequest(request_id + _PREFILL, whole.prompt_token_ids, one, hashes)
        self._submit(now, self._index_of(remote), i, prefill)

    def _pool(self, role: Role) -> list[_Worker]:
        """The workers the planner may send new work of ``role``: not the draining ones."""
        prefill = role == "prefill"
        return [
            w for w in self._workers if (w.role == "prefill") == prefill and w.next_role is None
        ]

    def _accept(self, i: int, worker_id: str) -> int:
        """Record that request ``i`` decodes on ``worker_id``; that worker's index."""
        self._records[i].worker_id = worker_id
        w = self._index_of(worker_id)
        self._workers[w].record.requests += 1
        self._workers[w].routed += 1
        return w

    def _view(self, worker: _Worker, overlaps: dict[str, int]) -> WorkerView:
        load = worker.engine.load()
        return WorkerView(
            worker_id=worker.worker_id,
            running=load.running,
            waiting=load.waiting,
            kv_usage=load.kv_blocks_used / load.kv_blocks_total,
            in_flight=worker.routed,
            cached_blocks=overlaps.get(worker.worker_id, 0),
            waiting_prefill_tokens=load.waiting_prefill_tokens,
            block_size=worker.engine.block_size,
            kv_capacity_tokens=load.kv_blocks_total * worker.engine.block_size,
        )

    def _index_of(self, worker_id: str) -> int:
        return next(k for k, v in enumerate(self._workers) if v.worker_id == worker_id)

    def _submit(
        self, now: float, w: int, i: int, request: EngineRequest, handed_off: int = 0
    ) -> None:
        """``handed_off``: leading prompt tokens whose KV a prefill worker sent along."""
        worker = self._workers[w]
        try:
            if handed_off:
                worker.engine.add_handed_off(request, handed_off)
            else:
                worker.engine.add_request(request)
        except ValueError:  # larger than the worker's whole KV cache
            self._records[i].failed = True
            self._streams.pop(i, None)
            self._handoffs.pop(i, None)
            self._workers[self._index_of(self._records[i].worker_id or "")].routed -= 1
            return
        self._owner[request.request_id] = i
        worker.in_flight += 1
        if not worker.stepping:
            self._start_step(now, worker, w)

    def _kv_arrived(self, now: float, i: int, resumed: Continuation) -> None:
        """The prompt's KV reached the decode worker: it streams the first token (a live client
        sees it only now) and continues from it."""
        w, whole, _ = self._handoffs.pop(i)
        self._stream(now, i, resumed.first, stalled=False)
        self._workers[w].engine.import_blocks(whole.block_hashes)
        rest = resumed.rest
        assert rest is not None  # a prompt prefills remotely for more than one token
        self._submit(now, w, i, rest, resumed.handed_off_tokens)

    def _start_step(self, now: float, worker: _Worker, w: int) -> None:
        result = worker.engine.step()
        if result.duration_s <= 0 and not result.outputs:
            self._fold(worker, result.kv_changes)
            worker.stepping = False  # nothing could be scheduled: wait for the next arrival
            return
        worker.stepping = True
        worker.record.busy.append((now, now + result.duration_s))
        worker.busy_in_role += result.duration_s
        self._push(now + result.duration_s, _STEP_END, w, result)

    def _step_end(self, now: float, worker: _Worker, w: int, result: StepResult) -> None:
        # A live worker publishes a step's KV events when the step is done; so does this.
        self._fold(worker, result.kv_changes)
        stalled = result.prefill_tokens > 0
        for output in result.outputs:
            i = self._owner[output.request_id]
            prefilled = output.request_id.endswith(_PREFILL)
            if not prefilled:
                self._stream(now, i, output, stalled)
            if output.finished:
                del self._owner[output.request_id]
                worker.in_flight -= 1
                if prefilled:
                    self._hand_off(now, worker, i, output)
                else:
                    worker.routed -= 1
                    del self._streams[i]
        worker.stepping = False
        if worker.engine.has_work():
            self._start_step(now, worker, w)
        elif worker.next_role is not None and worker.in_flight == 0:
            self._switch(now, worker)

    def _plan(self, now: float) -> None:
        assert self._capacity is not None
        interval = self._capacity.settings.interval_s
        since = now - interval
        recent = [
            r for r in self._records if r.first_token_s is not None and r.first_token_s >= since
        ]
        gaps, self._interval_gaps = self._interval_gaps, LatencyHistogram()
        stalled, self._interval_stalled = self._interval_stalled, 0
        prefill, decode = self._pool("prefill"), self._pool("decode")
        decision = self._capacity.decide(
            observe_interval(
                [
                    (((r.first_token_s or 0.0) - r.arrival_s) * 1000, bool(r.prefill_worker_id))
                    for r in recent
                ],
                gaps,
                stalled,
                sum(w.engine.load().waiting_prefill_tokens for w in prefill),
                len(prefill),
                len(decode),
            )
        )
        if decision.move is not None:
            pool = decode if decision.move == "to_prefill" else prefill
            target: Role = "prefill" if decision.move == "to_prefill" else "decode"
            moved = workers_to_move([self._view(w, {}) for w in pool], decision.workers)
            for worker in (self._workers[self._index_of(w)] for w in moved):
                worker.next_role = target
                if worker.in_flight == 0:
                    self._switch(now, worker)
            self._record_roles(now, decision.reason)
        self._push(now + interval, _PLAN, 0)

    def _switch(self, now: float, worker: _Worker) -> None:
        assert worker.next_role is not None
        self._close_role(now, worker)
        worker.role, worker.next_role = worker.next_role, None
        self._record_roles(now, f"{worker.worker_id} is now {worker.role}")

    def _close_role(self, now: float, worker: _Worker) -> None:
        self._pools.add(worker.role, now - worker.role_since, worker.busy_in_role)
        worker.role_since, worker.busy_in_role = now, 0.0

    def _record_roles(self, now: float, reason: str) -> None:
        self._roles_timeline.append(
            {
                "t": round(now, 3),
                "prefill": sum(1 for w in self._workers if w.role == "prefill"),
                "decode": sum(1 for w in self._workers if w.role != "prefill"),
                "reason": reason,
            }
        )

    def _stream(self, now: float, i: int, output: RequestOutput, stalled: bool) -> None:
        """Request ``i``'s output, into its stream and its record."""
        stream = self._streams[i]
        stream.push(output, now, stalled)
        record = self._records[i]
        record.last_token_s, record.output_tokens = stream.last_token, stream.emitted
        gap = stream.last_gap_ms
        if gap is None:
            record.first_token_s, record.cached_tokens = stream.first_token, stream.cached_tokens
        else:
            record.token_gaps_ms.append(gap)
            if self._capacity is not None:
                self._interval_gaps.add(gap)
                self._interval_stalled += stalled

    def _hand_off(self, now: float, prefill: _Worker, i: int, output: RequestOutput) -> None:
        """The prefill worker sampled request ``i``'s first token (``output``): its KV crosses
        the link to the decode worker, which then streams the first token and goes on."""
        _, whole, cached = self._handoffs[i]
        request = self._trace[i]
        first = output.new_token_ids[-1]
        resumed = continuation(
            whole,
            first,
            prefill.engine.block_size,
            cached_tokens=output.cached_tokens,
            prompt=self._prompts.prompt(request, tail=(first,)),
        )
        tokens = handoff_tokens(request.input_length, cached, prefill.engine.block_size)
        self._push(
            now + self._disagg.transfer.transfer_ms(tokens) / 1000.0, _KV_ARRIVED, i, resumed
        )

    def _fold(self, worker: _Worker, changes: list[KvChange]) -> None:
        for change in changes:
            worker.kv_seq += 1
            self._index.apply(kv_event(change, worker.worker_id, worker.kv_seq))
