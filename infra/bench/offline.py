"""Offline replay: a discrete-event simulation in one process, on a simulated clock.

It drives the planner's policy, the kv-indexer's index and the sim engine, unchanged, the way
the live services do: a request arrives, the policy picks a worker from the workers' load and
(if it asks) the index's overlaps, the worker's engine steps, and its KV events fold into the
index when the step ends (how workers step: :mod:`infra.bench.stepping`). Deterministic for a
given trace, policy and seed.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from infra.bench.hashes_ahead import HashesAhead
from infra.bench.metrics import (
    PoolUsage,
    ReplayResult,
    WorkerRecord,
    build_report,
    busy_timeline,
    by_model,
)
from infra.bench.sim_worker import SimWorker
from infra.bench.stepping import PREFILL, STEP_END, ReplaySteps
from infra.bench.tiers import OutputLengths, TierSettings, placement
from infra.bench.traces import PromptFactory, TraceRequest
from schemas.block_hash import salt_root
from schemas.events import Role, SamplingParams
from schemas.latency import LatencyHistogram
from services.engine.continuation import Continuation, continuation, handoff_tokens
from services.engine.protocol import EngineRequest, RequestOutput
from services.engine.sim import SimConfig, SimEngine, perf_model
from services.planner.capacity import (
    CapacityPlanner,
    CapacitySettings,
    observe_interval,
    workers_to_move,
)
from services.planner.decision import Decision, DecisionInputs, decide
from services.planner.disagg import DisaggSettings, handoff_link
from services.planner.kv_policy import KvAware
from services.planner.policy import Policy, RouteRequest
from services.planner.routable import with_room

_ARRIVAL, _KV_ARRIVED, _PLAN = 0, 2, 3
# Arrivals between two calls of the progress callback: off the per-event path.
_PROGRESS_EVERY = 64


class OfflineReplay(ReplaySteps):
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        policy: Policy,
        workers: int,
        config: SimConfig,
        prefill_workers: int = 0,
        disagg: DisaggSettings | None = None,
        autoscale: CapacitySettings | None = None,
        tiers: TierSettings | None = None,
        pools: dict[str, int] | None = None,
    ) -> None:
        """``workers`` serve requests end to end (role ``both``), or decode only when
        ``prefill_workers`` (role ``prefill``) are added beside them. ``tiers``: the workers'
        topology and the output lengths the planner is told (a host tier is in ``config``).
        ``pools``: model name to workers, where they serve several models (``workers`` their
        sum): each request goes to its model's (``TraceRequest.model``)."""
        models = [name for name, count in (pools or {}).items() for _ in range(count)]
        if models and (len(models) != workers or prefill_workers or autoscale):
            raise ValueError("model pools take all the workers, none of them prefill only")
        self._policy = policy
        self._config = config
        self._prompts = PromptFactory(config.block_size)
        self._hashes: HashesAhead  # from `run` on
        perf = perf_model(config.perf_model)
        # By default the planner is told the true output length, as a live client's max_tokens.
        self._tiers = tiers or TierSettings(output_length="oracle")
        place = partial(placement, topology=self._tiers.topology)  # prefill workers first
        pool = [
            SimWorker(f"p{i:03d}", SimEngine(config, perf), WorkerRecord(), "prefill", place(i))
            for i in range(prefill_workers)
        ]
        pool += [
            SimWorker(
                f"w{i:03d}",
                SimEngine(config, perf),
                WorkerRecord(),
                "decode" if prefill_workers else "both",
                place(prefill_workers + i),
                model=models[i] if models else None,
            )
            for i in range(workers)
        ]
        self._host_tier = config.num_host_blocks > 0
        self._pooled = bool(models)
        lengths = OutputLengths(self._tiers, config.num_gpu_blocks * config.block_size)
        super().__init__(trace, pool, lengths, watch_gaps=autoscale is not None)
        self._kv_moves = 0
        self._disagg = disagg or DisaggSettings(mode="never")
        self._capacity = CapacityPlanner(autoscale) if autoscale else None
        self._roles_timeline: list[dict[str, Any]] = []
        self._pools = PoolUsage()
        if (prefill_workers or autoscale) and not isinstance(policy, KvAware):
            raise ValueError("disaggregation needs the kv policy's cost model")
        # Every routing decision with its inputs, when asked for (`laneway bench --decisions`).
        self.decisions: list[tuple[DecisionInputs, Decision]] | None = None
        # Called with the arrivals so far, now and then (`laneway bench`'s progress).
        self.progress: Callable[[int], None] | None = None
        # Every sim engine can hand a prompt's KV over.
        self._handoff = frozenset(w.worker_id for w in self._workers)
        self._max_num_seqs = {w.worker_id: config.max_num_seqs for w in self._workers}
        self._remote_prefills = 0
        # Decode-side state of requests whose prompt a prefill worker is computing.
        self._handoffs: dict[int, tuple[int, EngineRequest, int]] = {}

    @property
    def lengths(self) -> OutputLengths:
        """The output lengths the planner is told, and what its predictor learned."""
        return self._lengths

    def run(self) -> ReplayResult:
        # Millions of short-lived objects and no cycles worth collecting: the collector's passes
        # over the long-lived ones (records, engine state) are a tenth of a replay.
        collecting = gc.isenabled()
        gc.disable()
        self._hashes = HashesAhead(self._trace, self._prompts)
        try:
            return self._run()
        finally:
            self._hashes.close()
            if collecting:
                gc.enable()

    def _run(self) -> ReplayResult:
        started = time.perf_counter()
        for i, request in enumerate(self._trace):
            self._push(request.arrival_s, _ARRIVAL, i)
        if self._capacity is not None:
            self._record_roles(0.0, "start")
            self._push(self._capacity.settings.interval_s, _PLAN, 0)
        prefill = any(w.role == "prefill" for w in self._workers)
        self._catching_up = self.catch_up and not prefill and self._capacity is None
        now = 0.0
        events = self._events
        while events:
            now, _, kind, who, payload = heapq.heappop(events)
            if self._catching_up:
                self._catch_up(now)
                self._until = events[0][0] if events else math.inf
            if kind == _ARRIVAL:
                self._arrive(now, who)
                if self.progress is not None and who % _PROGRESS_EVERY == 0:
                    self.progress(who)
            elif kind == STEP_END:
                self._step_end(now, self._workers[who], who, payload)
            elif kind == _KV_ARRIVED:
                self._kv_arrived(now, who, payload)
            elif len(self._events) > 0:  # plan while there is traffic left
                self._plan(now)
        if self._catching_up:
            now = max(now, self._catch_up(math.inf))
        records = {w.worker_id: w.record for w in self._workers}
        report = build_report(self._records, records, time.perf_counter() - started)
        report["busy_timeline"] = busy_timeline(records, report["duration_s"])
        for worker in self._workers:
            self._close_role(now, worker)
        report["pool_busy_fraction"] = self._pools.fractions()
        report["remote_prefills"] = self._remote_prefills
        report["kv_moves"] = self._kv_moves
        report["lora_loads"] = sum(w.engine.lora_loads for w in self._workers)
        report["kv_tiers"] = self._tiers.report()
        report["output_length"] = self._lengths.report()
        if self._pooled:
            report["models"] = by_model(self._records, [r.model for r in self._trace])
        if self._capacity is not None:
            report["roles_timeline"] = self._roles_timeline
        decisions = [d.record(i.request.request_id) for i, d in self.decisions or ()]
        return ReplayResult(report, self._records, decisions)

    def _arrive(self, now: float, i: int) -> None:
        request = self._trace[i]
        # A trace may name models (a recording's do) where the workers serve one.
        model = request.model if self._pooled else None
        hashes = self._hashes.of(i)
        request_id = f"r{i}"
        max_tokens, expected = self._lengths.route(i, request.input_length, request.output_length)
        route = RouteRequest(
            request_id, request.input_length, hashes, None, max_tokens, expected, lora=request.lora
        )
        overlaps = {}
        tiered: tuple[int, ...] = ()
        if hashes and self._policy.wants_overlap(route):
            overlaps = self._index.overlaps(hashes)
            tiered = hashes if self._host_tier else ()
        inputs = DecisionInputs(
            route,
            with_room(
                [w.view(overlaps, self._index, tiered) for w in self._pool("decode", model)],
                self._max_num_seqs,
            ),
            [w.view(overlaps, self._index, tiered) for w in self._pool("prefill", model)],
            self._handoff,
        )
        decision = decide(self._policy, self._disagg, inputs)
        if self.decisions is not None:
            self.decisions.append((inputs, decision))
        w = self._accept(i, decision.worker_id)
        remote = decision.prefill_worker_id
        sampling = SamplingParams(max_tokens=request.output_length, ignore_eos=True)
        root = salt_root(request.cache_salt)
        prompt = self._prompts.prompt(request)
        whole = EngineRequest(request_id, prompt, sampling, hashes, root, request.lora)
        move = decision.kv_move
        if remote is None:
            if move is None:
                self._submit(now, w, i, whole)
            else:  # what the source holds (GPU or host tier) now is sent
                self._kv_moves += 1
                source = self._workers[self._index_of(move.source_worker_id)].engine
                blocks = source.held_prefix(hashes)
                self._submit(now, w, i, whole, moved=(blocks, move.transfer_ms))
            return
        self._remote_prefills += 1
        self._records[i].prefill_worker_id = remote
        # The decode worker's KV of the prompt when the planner decided, as a live one counts it.
        cached = next(v.cached_blocks for v in inputs.decoders if v.worker_id == decision.worker_id)
        self._handoffs[i] = (w, whole, cached)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        prefill = EngineRequest(
            request_id + PREFILL, whole.prompt_token_ids, one, hashes, root, whole.lora
        )
        self._submit(now, self._index_of(remote), i, prefill)

    def _pool(self, role: Role, model: str | None = None) -> list[SimWorker]:
        """The workers the planner may send new work of ``role``: not the draining ones, and of
        ``model``'s pool where one is given (None: all)."""
        prefill = role == "prefill"
        return [
            w
            for w in self._workers
            if (w.role == "prefill") == prefill
            and w.next_role is None
            and (model is None or w.model == model)
        ]

    def _accept(self, i: int, worker_id: str) -> int:
        """Record that request ``i`` decodes on ``worker_id``; that worker's index."""
        self._records[i].worker_id = worker_id
        w = self._index_of(worker_id)
        self._workers[w].record.requests += 1
        self._workers[w].routed += 1
        return w

    def _index_of(self, worker_id: str) -> int:
        return self._position[worker_id]

    def _submit(
        self,
        now: float,
        w: int,
        i: int,
        request: EngineRequest,
        handed_off: int = 0,
        moved: tuple[int, float] | None = None,
    ) -> None:
        """``handed_off``: leading prompt tokens whose KV a prefill worker sent along;
        ``moved``: the blocks another worker sends it, and the transfer's ms."""
        worker = self._workers[w]
        try:
            if handed_off:
                worker.engine.add_handed_off(request, handed_off)
            elif moved is not None:
                worker.engine.add_moved(request, *moved)
            else:
                worker.engine.add_request(request)
        except ValueError:  # larger than the worker's whole KV cache
            self._records[i].failed = True
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
        if resumed.rest is None:  # the first token was the last: nothing left to decode
            self._finished(now, i, self._workers[w])
        else:
            self._submit(now, w, i, resumed.rest, resumed.handed_off_tokens)

    def _plan(self, now: float) -> None:
        assert self._capacity is not None
        interval = self._capacity.settings.interval_s
        since = now - interval
        recent = [
            r for r in self._records if r.times.first_s is not None and r.times.first_s >= since
        ]
        gaps, self._interval_gaps = self._interval_gaps, LatencyHistogram()
        stalled, self._interval_stalled = self._interval_stalled, 0
        prefill, decode = self._pool("prefill"), self._pool("decode")
        decision = self._capacity.decide(
            observe_interval(
                [
                    (((r.times.first_s or 0.0) - r.arrival_s) * 1000, bool(r.prefill_worker_id))
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
            moved = workers_to_move([w.view({}, self._index) for w in pool], decision.workers)
            for worker in (self._workers[self._index_of(w)] for w in moved):
                worker.next_role = target
                if worker.in_flight == 0:
                    self._switch(now, worker)
            self._record_roles(now, decision.reason)
        self._push(now + interval, _PLAN, 0)

    def _switch(self, now: float, worker: SimWorker) -> None:
        assert worker.next_role is not None
        self._close_role(now, worker)
        worker.role, worker.next_role = worker.next_role, None
        self._record_roles(now, f"{worker.worker_id} is now {worker.role}")

    def _close_role(self, now: float, worker: SimWorker) -> None:
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

    def _hand_off(self, now: float, prefill: SimWorker, i: int, output: RequestOutput) -> None:
        """The prefill worker sampled request ``i``'s first token (``output``): its KV crosses
        the link to the decode worker, which then streams the first token and goes on."""
        w, whole, cached = self._handoffs[i]
        request = self._trace[i]
        assert isinstance(self._policy, KvAware)  # disaggregation needs its cost model
        views = prefill.view({}, self._index), self._workers[w].view({}, self._index)
        link = handoff_link(self._policy, self._disagg, *views)
        first = output.new_token_ids[-1]
        resumed = continuation(
            whole,
            first,
            prefill.engine.block_size,
            cached_tokens=output.cached_tokens,
            prompt=self._prompts.prompt(request, tail=(first,)),
        )
        tokens = handoff_tokens(request.input_length, cached, prefill.engine.block_size)
        self._push(now + link.transfer_ms(tokens) / 1000.0, _KV_ARRIVED, i, resumed)
