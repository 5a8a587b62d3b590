"""Prometheus metrics of one ingress app, in its own registry so that several apps (tests, or
more than one per process) never share or collide on counters."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from observability.drops import count_drops_in

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Client closed the connection before the answer was complete (nginx's convention).
CLIENT_CLOSED_STATUS = 499

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0)
# A loop that keeps up is late by a turn's length (a few ms); 0.2 s makes it busy and 0.5 s
# behind (services/ingress/loop_lag.py).
_LATE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        count_drops_in(self.registry)
        self._requests = Counter(
            "laneway_ingress_requests",
            "HTTP requests by endpoint and final status (499: client went away).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "laneway_ingress_requests_in_flight",
            "Completion requests waiting on the cluster.",
            registry=self.registry,
        )
        self.admitted = Counter(
            "laneway_ingress_admitted",
            "Completion requests admitted into the cluster, by priority.",
            ["priority"],
            registry=self.registry,
        )
        self.shed = Counter(
            "laneway_ingress_shed",
            "Completion requests answered 429 for lack of room, by reason (queue_full, "
            "wait_timeout, displaced: by a higher priority) and priority.",
            ["reason", "priority"],
            registry=self.registry,
        )
        self.auth_refused = Counter(
            "laneway_ingress_auth_refused",
            "Requests refused at the API-key check, by error code (missing_api_key, "
            "invalid_api_key, insufficient_scope, rate_limit_exceeded, keys_loading) and "
            "tenant (empty before a key is known).",
            ["code", "tenant"],
            registry=self.registry,
        )
        self.admission_queue = Gauge(
            "laneway_ingress_admission_queue_depth",
            "Requests waiting at this ingress for room in the cluster.",
            registry=self.registry,
        )
        self.tenant_limits_shared = Gauge(
            "laneway_ingress_tenant_limits_shared",
            "1 while tenants' limits hold across the ingress replicas (etcd reached; and where "
            "no keys are taken); 0 while each replica holds each tenant to its share.",
            registry=self.registry,
        )
        self.admission_capacity = Gauge(
            "laneway_ingress_admission_capacity",
            "Requests the cluster may hold (0: no bound known yet).",
            registry=self.registry,
        )
        self.admission_in_cluster = Gauge(
            "laneway_ingress_admission_in_cluster",
            "Requests in the cluster as this ingress counts them: its own and, from the "
            "workers' load reports, other replicas'.",
            registry=self.registry,
        )
        self._ttft = Histogram(
            "laneway_ingress_ttft_seconds",
            "Request received to first generated token, seconds.",
            ["endpoint", "model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "laneway_ingress_e2e_latency_seconds",
            "Request received to terminal event, seconds, for completed requests.",
            ["endpoint", "model"],
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self._itl = Histogram(
            "laneway_ingress_itl_seconds",
            "Mean inter-token latency of each completed request of two tokens or more: "
            "(E2E − TTFT) / (completion tokens − 1), seconds.",
            ["endpoint", "model"],
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.loop_late = Histogram(
            "laneway_ingress_loop_late_seconds",
            "How late each 50 ms tick of the event loop's clock came, seconds: the wait of "
            "everything the ingress does (a request read, a token written) for the work "
            "queued ahead of it, CPU starvation included.",
            buckets=_LATE_BUCKETS,
            registry=self.registry,
        )
        self._prompt_tokens = Counter(
            "laneway_ingress_prompt_tokens",
            "Prompt tokens of completed requests, by model and tenant ('-': no keys taken).",
            ["model", "tenant"],
            registry=self.registry,
        )
        self._cached_tokens = Counter(
            "laneway_ingress_cached_prompt_tokens",
            "Prompt tokens of completed requests that were served from a KV cache.",
            ["model", "tenant"],
            registry=self.registry,
        )
        self._completion_tokens = Counter(
            "laneway_ingress_completion_tokens",
            "Generated tokens of completed requests.",
            ["model", "tenant"],
            registry=self.registry,
        )
        # Each request's labelled series, looked up once: labels() validates and locks per call.
        self._children: dict[tuple[object, ...], Any] = {}

    def _child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, endpoint: str, status: int) -> None:
        self._child(self._requests, endpoint, str(status)).inc()

    def first_token(self, endpoint: str, model: str, seconds: float) -> None:
        self._child(self._ttft, endpoint, model).observe(seconds)

    def completed(
        self,
        endpoint: str,
        model: str,
        seconds: float,
        ttft_s: float | None,
        prompt: int,
        cached: int,
        completion: int,
        tenant: str | None = None,
    ) -> None:
        self._child(self._e2e, endpoint, model).observe(seconds)
        if ttft_s is not None and completion > 1:
            itl = (seconds - ttft_s) / (completion - 1)
            self._child(self._itl, endpoint, model).observe(itl)
        charged = tenant or "-"
        self._child(self._prompt_tokens, model, charged).inc(prompt)
        self._child(self._cached_tokens, model, charged).inc(cached)
        self._child(self._completion_tokens, model, charged).inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)
