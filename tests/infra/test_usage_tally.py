"""`laneway usage`'s sums, from terminal events: a finished request is charged its usage, a
cancelled one its prompt (once it produced a token) and the tokens before the stop, a failed one
nothing; each request once, per tenant and model."""

from __future__ import annotations

from infra.usage import NO_TENANT, tally
from schemas.events import Event, RequestCancelled, RequestFailed, RequestFinished, Usage


def finished(rid: str, tenant: str | None, prompt: int, completion: int) -> RequestFinished:
    return RequestFinished(
        source="w",
        request_id=rid,
        worker_id="w1",
        finish_reason="length",
        usage=Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=prompt // 2),
        ttft_ms=1.0,
        e2e_ms=2.0,
        tenant=tenant,
        model="m",
    )


def test_terminal_events_sum_per_tenant_and_model() -> None:
    cut = RequestCancelled(
        source="w", request_id="c", reason="client left", completion_tokens=3,
        prompt_tokens=40, cached_tokens=8, tenant="acme", model="m2",
    )  # fmt: skip
    failed = RequestFailed(source="w", request_id="f", code="engine_error", message="x")
    events: list[Event] = [
        finished("a", "acme", 10, 4),
        finished("a", "acme", 10, 4),  # a redelivery: once
        finished("b", "acme", 20, 6),
        cut,
        failed,
        finished("n", None, 7, 1),
    ]
    got = tally(events)["tenants"]
    assert got["acme"]["requests"] == 3
    assert (got["acme"]["prompt_tokens"], got["acme"]["completion_tokens"]) == (70, 13)
    assert got["acme"]["cached_tokens"] == 5 + 10 + 8
    assert got["acme"]["models"]["m2"] == {
        "requests": 1, "prompt_tokens": 40, "cached_tokens": 8, "completion_tokens": 3,
    }  # fmt: skip
    assert got[NO_TENANT]["completion_tokens"] == 1
    assert set(tally(events, "acme")["tenants"]) == {"acme"}
