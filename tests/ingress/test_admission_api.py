"""Admission control through the HTTP API: a full cluster answers 429 with Retry-After at once,
and the priority a client asks for (header or body) decides who waits first."""

from __future__ import annotations

import asyncio
import time

from services.ingress.admission import AdmissionSettings
from services.ingress.metrics import IngressMetrics
from services.ingress.pool_admission import pooled
from tests.helpers import eventually
from tests.ingress.fakes import Hang
from tests.ingress.helpers import MODEL, chat_body, completion_body, harness


async def test_a_full_cluster_answers_429_with_retry_after_fast() -> None:
    metrics = IngressMetrics()
    admission = pooled(AdmissionSettings(max_in_flight=1, max_wait_s=0.02), metrics)
    async with harness([Hang()], admission=admission, metrics=metrics, request_timeout_s=2.0) as h:
        holding = asyncio.create_task(h.client.post("/v1/completions", json=completion_body()))
        await eventually(lambda: h.gateway.submitted)
        started = time.perf_counter()
        shed = await h.client.post("/v1/chat/completions", json=chat_body())
        elapsed = time.perf_counter() - started
        assert shed.status_code == 429
        assert elapsed < 0.1
        assert shed.headers["retry-after"] == "1"
        assert shed.headers["content-type"] == "application/json"
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert shed.json()["error"]["code"] == "server_overloaded"
        # Only the admitted request reached the cluster.
        assert len(h.gateway.submitted) == 1
        rendered = (await h.client.get("/metrics")).text
        assert 'laneway_ingress_shed_total{priority="normal",reason="wait_timeout"} 1.0' in rendered
        assert 'requests_total{endpoint="chat_completions",status="429"} 1.0' in rendered
        await h.gateway.cancel(h.gateway.submitted[0].request_id, "timeout")
        await holding
    # Its room was given back.
    assert admission.in_cluster == 0


async def test_an_invalid_request_is_refused_for_that_even_when_full() -> None:
    admission = pooled(AdmissionSettings(max_in_flight=1), IngressMetrics())
    ticket = await admission.admit("normal", MODEL)
    async with harness(admission=admission) as h:
        response = await h.client.post("/v1/completions", json=completion_body(max_tokens=0))
    assert response.status_code == 400
    ticket.release()


async def test_priority_from_the_header_or_the_body() -> None:
    metrics = IngressMetrics()
    admission = pooled(AdmissionSettings(), metrics)
    async with harness(admission=admission, metrics=metrics) as h:
        post = h.client.post
        assert (await post("/v1/completions", json=completion_body(priority="low"))).is_success
        headers = {"x-laneway-priority": "HIGH"}
        body = completion_body(priority="low")
        assert (await post("/v1/completions", json=body, headers=headers)).is_success
        assert (await post("/v1/chat/completions", json=chat_body())).is_success
        # The planner is told each one's class with its spec.
        assert [s.spec.priority for s in h.gateway.submitted] == ["low", "high", "normal"]
        bad_body = await post("/v1/completions", json=completion_body(priority=1))
        bad_header = await post(
            "/v1/completions", json=completion_body(), headers={"x-laneway-priority": "urgent"}
        )
    assert bad_body.status_code == 400
    assert bad_body.json()["error"]["param"] == "priority"
    assert bad_header.status_code == 400
    assert bad_header.json()["error"]["param"] == "x-laneway-priority"

    def admitted(priority: str) -> float | None:
        return metrics.registry.get_sample_value(
            "laneway_ingress_admitted_total", {"priority": priority}
        )

    assert (admitted("low"), admitted("high"), admitted("normal")) == (1.0, 1.0, 1.0)


async def test_a_shed_waiter_at_the_api_frees_nothing_it_did_not_take() -> None:
    admission = pooled(AdmissionSettings(max_in_flight=2, max_wait_s=0.01), IngressMetrics())
    async with harness(admission=admission) as h:
        replies = await asyncio.gather(
            *(h.client.post("/v1/completions", json=completion_body()) for _ in range(20))
        )
    assert {r.status_code for r in replies} <= {200, 429}
    assert admission.in_cluster == 0
    assert admission.queued == 0
