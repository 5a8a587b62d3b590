"""A worker's lifecycle: it holds a lease in etcd while it serves, reports its load, and leaves
the pool by draining, whether it stops or the capacity loop gives it another role: no new work
comes, in-flight work finishes, then it goes (or comes back in the new role)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine

from prometheus_client import CollectorRegistry

from bus.client import Bus
from bus.registry import LeasedKey, RoleChanged, connect_etcd, watch_role
from bus.runtime import run_service
from bus.topology import Subjects, worker_routes
from observability.metrics import MetricsServer
from observability.tracing import setup_tracing
from schemas.events import Role
from schemas.messages import WorkerRegistration
from services.common.tokenizer import Tokenizer
from services.engine.protocol import Engine, EngineLoad, StepResult
from services.worker.decode_side import DecodeSide
from services.worker.driver import EngineDriver
from services.worker.handlers import Handlers
from services.worker.handoff import KvReceiver, KvSender, PrefillSide
from services.worker.kv_move import KvMoves
from services.worker.metrics import WorkerMetrics
from services.worker.outputs import Background, Outputs
from services.worker.parts import WorkerParts
from services.worker.requests import Requests
from services.worker.settings import WorkerOptions, WorkerSettings, build_engine, worker_options
from services.worker.step_cost import StepCostFit

# A draining worker hands on what is routed to it anyway, so the notice is worth only a moment.
DRAINING_NOTICE_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self, bus: Bus, engine: Engine, tokenizer: Tokenizer, options: WorkerOptions
    ) -> None:
        self._bus = bus
        self._opt = options
        self._background = Background()
        # Decode steps within a token interval of each other go out in one batch anyway: they
        # are done at once where no request's stop strings need them token by token.
        self._driver = EngineDriver(
            engine,
            options.speedup,
            options.token_interval_s,
            lambda: self._requests.runs_allowed(),
        )
        self.metrics = WorkerMetrics(lambda: self._driver.busy_s)
        # A simulated engine's step times are its perf model's, which the planner has already.
        self._step_cost = None if engine.capabilities.modelled_time else StepCostFit()
        self._outputs = Outputs(
            bus,
            options.worker_id,
            self._background,
            options.token_interval_s,
            options.kv_interval_s,
        )
        self._receiver = KvReceiver(
            engine.block_size,
            options.kv_transfer,
            options.speedup,
            options.handoff_timeout_s,
            options.handoff_timeout_factor,
        )
        sender = KvSender(
            bus, options.worker_id, self._outputs.source, engine.block_size, self.metrics.handoffs
        )
        prefill = PrefillSide(sender, self._driver, self._background)
        self._requests = Requests(self._driver, self._outputs, prefill, self._receiver.blobs)
        parts = WorkerParts(
            self._requests, self._receiver, self._driver, self._outputs, self._background
        )
        decode = DecodeSide(parts, self.metrics.handoffs)
        self._moves = KvMoves(bus, parts, self.metrics.registry)
        self._handlers = Handlers(
            options.worker_id,
            self._requests,
            prefill,
            decode,
            tokenizer,
            moves=self._moves,
        )
        self._reported_at = 0.0
        self._reported: EngineLoad | None = None
        self._lease: LeasedKey | None = None
        # In the pool: its lease taken and its routes consumed, until it stops.
        self.serving = False
        # The role the capacity loop gave this worker, taken once in-flight work is done.
        self._next_role: Role | None = None

    def registration(self) -> WorkerRegistration:
        engine = self._driver.engine
        return WorkerRegistration(
            worker_id=self._opt.worker_id,
            role=self._opt.role,
            engine=self._opt.engine_kind,
            model=self._opt.model,
            block_size=engine.block_size,
            kv_blocks_total=engine.kv_blocks_total,
            max_num_seqs=engine.max_num_seqs,
            max_model_len=self._opt.max_model_len or engine.max_model_len,
            kv_events=self._opt.kv_events,
            kv_handoff=self._driver.portable is not None,
            structured_outputs=engine.capabilities.structured_outputs,
            logprobs=engine.capabilities.logprobs,
            kv_bytes_per_token=engine.capabilities.kv_bytes_per_token,
            max_loras=engine.capabilities.max_loras,
            draining=self._next_role is not None or self._handlers.draining,
            pid=os.getpid(),
            node=self._opt.node,
            rack=self._opt.rack,
        )

    async def run(
        self,
        lease: LeasedKey,
        stop: asyncio.Event,
        watch_role: Callable[[RoleChanged], Coroutine[object, object, None]] | None = None,
    ) -> None:
        self._lease = lease
        await lease.start()
        await self._bus.subscribe(Subjects.cancellation_requested, self._handlers.on_cancel)
        # Answered from the bytes it kept, and with the chunks first: no typed handler.
        await self._bus.subscribe_bytes(
            Subjects.resend(self._opt.worker_id).subject, self._outputs.on_resend
        )
        await self._bus.subscribe_bytes(
            Subjects.kv_handoff(self._opt.worker_id), self._receiver.blobs.on_msg
        )
        await self._bus.subscribe_bytes(
            Subjects.kv_pull(self._opt.worker_id).subject, self._moves.on_pull
        )
        await self._bus.subscribe(
            Subjects.prefilled(self._opt.worker_id), self._handlers.on_prefilled
        )
        await self._bus.consume(worker_routes(self._opt.worker_id), self._handlers.on_route)
        loops = [
            asyncio.create_task(
                self._driver.run(self._on_step, self._requests.engine_failed, self._outputs.idle),
                name="engine-steps",
            ),
            asyncio.create_task(self._report_loop(), name="load-reports"),
        ]
        if watch_role is not None:
            loops.append(asyncio.create_task(watch_role(self._on_role), name="role-watch"))
        log.info("worker %s (%s) ready", self._opt.worker_id, self._opt.role)
        self.serving = True
        await stop.wait()
        self.serving = False
        # Draining: still registered (so the planner does not declare its requests lost) but
        # taking no new work; what does not finish in time moves to other workers (the ingress
        # continues it from its tokens when it hears worker_lost), then the worker leaves.
        self._handlers.draining = True
        if self._requests.in_flight:
            await self._say_draining()
        await self._drained(self._opt.drain_timeout_s)
        await self._requests.end_all()
        await self._background.finish()
        await lease.stop()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await self._background.finish()

    async def _drained(self, timeout_s: float | None = None) -> None:
        """Wait until no request is in flight here any more (at most ``timeout_s``): a worker
        out of the pool, stopping or changing roles, finishes what it holds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._requests.in_flight and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.05)

    # -- role changes ---------------------------------------------------------------------

    async def _on_role(self, role: Role) -> None:
        """Leave the old role's pool at once (draining: no new work), finish what is in flight,
        then join the new one."""
        if role == (self._next_role or self._opt.role):
            return
        switching = self._next_role is not None
        self._next_role = role
        await self._register()
        if not switching:
            self._background.spawn(self._switch_when_drained())

    async def _switch_when_drained(self) -> None:
        await self._drained()
        assert self._next_role is not None
        log.info("worker %s: role %s → %s", self._opt.worker_id, self._opt.role, self._next_role)
        self._opt.role, self._next_role = self._next_role, None
        await self._register()
        await self._report_load()

    async def _say_draining(self) -> None:
        """Registered as draining, so the planner routes nothing new here; bounded, since an
        etcd that is gone (``laneway up`` killed with everything) must not hold the exit."""
        try:
            await asyncio.wait_for(self._register(), DRAINING_NOTICE_TIMEOUT_S)
        except Exception:
            log.warning("could not register as draining; routes that still come are handed on")

    async def _register(self) -> None:
        if self._lease is not None:
            await self._lease.update(self.registration().model_dump_json().encode())

    # -- each step, and the load ----------------------------------------------------------

    async def _on_step(self, result: StepResult) -> None:
        self.metrics.step(result, self._driver.last_step_s)
        if self._step_cost is not None:
            self._step_cost.observe(
                result.prefill_tokens, len(result.outputs), result.duration_s * 1000.0
            )
        await self._requests.fail_refused()
        times: tuple[float, ...] = ()
        if result.step_ends_s:  # several steps at once: each token at its step's end
            now, left = time.monotonic(), result.duration_s
            speedup = self._opt.speedup
            times = tuple(now - (left - end) / speedup for end in result.step_ends_s)
        for output in result.outputs:
            await self._requests.output(
                output, stalled=result.prefill_tokens > 0, step=self._driver.steps, times=times
            )
        if self._opt.kv_events:
            await self._outputs.kv(result.kv_changes)
        loop = asyncio.get_running_loop()
        if loop.time() - self._reported_at >= self._opt.busy_report_interval_s:
            load = self._driver.engine.load()
            if moved(self._reported, load):
                await self._report_load(load)
        # Last: everything the step published goes out in one write (a wake-up fewer of the
        # server and its subscribers, each dear), tokens and terminals behind the KV events.
        await self._outputs.flush(step_end=True)

    async def _report_loop(self) -> None:
        while True:
            await self._report_load()
            await asyncio.sleep(self._opt.load_report_interval_s)

    async def _report_load(self, load: EngineLoad | None = None) -> None:
        self._reported_at = asyncio.get_running_loop().time()
        load = self._driver.engine.load() if load is None else load
        self._reported = load
        self.metrics.load(load)
        step_cost = self._step_cost.estimate() if self._step_cost is not None else None
        await self._outputs.load(self._opt.role, load, self._driver.busy_s, step_cost)


def moved(before: EngineLoad | None, now: EngineLoad) -> bool:
    """Whether ``now`` tells the planner's cost model something ``before`` did not: a request
    queued, started or ended, an adapter loaded, or KV occupancy moved by a hundredth. A step
    that only decoded goes out with the next periodic report: at 20 a second per worker, those
    made a third of the bus's bytes, each copied to every replica and every planner, while
    most said nothing new (issue 38, docs/operations.md)."""
    if before is None:
        return True
    if (before.running, before.waiting, before.waiting_prefill_tokens, before.loras) != (
        now.running,
        now.waiting,
        now.waiting_prefill_tokens,
        now.loras,
    ):
        return True
    return abs(now.kv_blocks_used - before.kv_blocks_used) * 100 >= max(now.kv_blocks_total, 1)


def worker_main(default_role: Role) -> None:
    """Run a worker process in ``default_role``, unless the operator set LANEWAY_ROLE."""
    settings = (
        WorkerSettings() if "LANEWAY_ROLE" in os.environ else WorkerSettings(role=default_role)
    )

    async def main(stop: asyncio.Event) -> None:
        setup_tracing("laneway-worker", settings.worker_id, settings.trace_exporter)
        # Up before the engine loads (a real model takes minutes): alive, not yet ready.
        metrics = MetricsServer(CollectorRegistry())
        await metrics.start(settings.metrics_host, settings.metrics_port)
        bus = await Bus.connect(settings.nats_url, f"worker-{settings.worker_id}")
        await bus.provision(settings.stream_replicas, settings.bus_provisioned)
        etcd = connect_etcd(settings.etcd_endpoints)
        engine, tokenizer = build_engine(settings)
        worker = Worker(bus, engine, tokenizer, worker_options(settings, engine))
        metrics.registry = worker.metrics.registry
        metrics.ready_when("bus", lambda: bus.nc.is_connected)
        metrics.ready_when("lease and engine", lambda: worker.serving)
        lease = LeasedKey.worker(etcd, worker.registration(), settings.lease_ttl_s)
        try:
            await worker.run(
                lease, stop, lambda changed: watch_role(etcd, settings.worker_id, changed)
            )
        finally:
            await metrics.close()
            await bus.close()
            await etcd.close()

    run_service(main, settings.log_level)
