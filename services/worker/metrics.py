"""A worker's Prometheus metrics, in a registry of its own. The engine's load is set with each
load report (already computed then); a step costs a histogram observation and two counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from observability.drops import count_drops_in
from services.engine.protocol import EngineLoad, StepResult

_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _Busy(Collector):
    def __init__(self, busy_s: Callable[[], float]) -> None:
        self._busy_s = busy_s

    def collect(self) -> Iterator[CounterMetricFamily]:
        # Its rate is the worker's utilisation: the share of time its engine was stepping.
        yield CounterMetricFamily(
            "laneway_worker_busy_seconds",
            "Seconds the engine spent stepping (its rate: utilisation, 0 to 1).",
            value=self._busy_s(),
        )


class WorkerMetrics:
    def __init__(self, busy_s: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        count_drops_in(self.registry)
        self._waiting = Gauge(
            "laneway_worker_queue", "Requests waiting in the engine.", registry=self.registry
        )
        self._running = Gauge(
            "laneway_worker_running", "Requests the engine is running.", registry=self.registry
        )
        self._waiting_prefill = Gauge(
            "laneway_worker_queued_prefill_tokens",
            "Prompt tokens waiting to be prefilled.",
            registry=self.registry,
        )
        self._kv_usage = Gauge(
            "laneway_worker_kv_usage",
            "Share of the engine's KV blocks in use, 0 to 1.",
            registry=self.registry,
        )
        self._loras = Gauge(
            "laneway_worker_lora_adapters",
            "LoRA adapters resident in the engine.",
            registry=self.registry,
        )
        self._step = Histogram(
            "laneway_worker_step_seconds",
            "Engine steps, wall-clock seconds each (modelled time over the speed-up for sim).",
            buckets=_STEP_BUCKETS,
            registry=self.registry,
        )
        self._tokens = Counter(
            "laneway_worker_tokens",
            "Tokens computed, by kind: prefill (prompt tokens) and generated.",
            ["kind"],
            registry=self.registry,
        )
        self._generated = self._tokens.labels("generated")
        self._prefilled = self._tokens.labels("prefill")
        self.handoffs = Counter(
            "laneway_worker_handoffs",
            "KV hand-offs between prefill and decode workers, by side (sent, received) and "
            "outcome (ok, failed: the decode worker prefills locally).",
            ["side", "outcome"],
            registry=self.registry,
        )
        self.registry.register(_Busy(busy_s))

    def load(self, load: EngineLoad) -> None:
        self._waiting.set(load.waiting)
        self._running.set(load.running)
        self._waiting_prefill.set(load.waiting_prefill_tokens)
        total = load.kv_blocks_total
        self._kv_usage.set(load.kv_blocks_used / total if total else 0.0)
        self._loras.set(len(load.loras))

    def step(self, result: StepResult, seconds: float) -> None:
        """``seconds``: the wall time the result took, its steps' together."""
        steps = len(result.step_ends_s) or 1
        for _ in range(steps):
            self._step.observe(seconds / steps)
        self._generated.inc(sum(len(output.new_token_ids) for output in result.outputs))
        if result.prefill_tokens:
            self._prefilled.inc(result.prefill_tokens)
