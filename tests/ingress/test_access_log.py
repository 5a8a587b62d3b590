"""The access log: one info line per request when it ends, whatever the ending."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from services.ingress import access_log
from tests.ingress.fakes import Finish, Hang, Step, Tokens
from tests.ingress.helpers import MODEL, chat_body, completion_body, harness

Line = tuple[str, str, dict[str, str]]


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Callable[[], list[Line]]:
    """The access lines so far, each as its method, path and ``key=value`` fields."""
    caplog.set_level(logging.INFO, logger=access_log.__name__)

    def lines() -> list[Line]:
        out = []
        # Other loggers may write meanwhile (a connection of an earlier test closing).
        for record in caplog.records:
            if record.name != access_log.__name__:
                continue
            assert record.levelno == logging.INFO
            method, path, *fields = record.getMessage().split(" ")
            out.append((method, path, dict(field.split("=", 1) for field in fields)))
        return out

    return lines


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completed_request(access: Callable[[], list[Line]], stream: bool) -> None:
    script: list[Step] = [Tokens("Hel"), Tokens("lo"), Finish(cached_tokens=16)]
    async with harness(script) as h:
        response = await h.client.post("/v1/chat/completions", json=chat_body(stream=stream))
    assert response.status_code == 200
    (submitted,) = h.gateway.submitted
    ((method, path, fields),) = access()
    assert (method, path) == ("POST", "/v1/chat/completions")
    ttft_ms, total_ms = float(fields.pop("ttft_ms")), float(fields.pop("total_ms"))
    assert 0 < ttft_ms <= total_ms
    assert fields == {
        "status": "200",
        "id": submitted.request_id,
        "model": MODEL,
        "stream": str(stream).lower(),
        "prompt_tokens": str(len(submitted.spec.prompt_token_ids)),
        "cached_tokens": "16",
        "completion_tokens": "5",
    }


async def test_a_timed_out_request_has_an_id_but_no_tokens(
    access: Callable[[], list[Line]],
) -> None:
    async with harness([Hang()], request_timeout_s=0.01) as h:
        response = await h.client.post("/v1/completions", json=completion_body())
    assert response.status_code == 504
    ((_, path, fields),) = access()
    assert path == "/v1/completions"
    assert fields["status"] == "504"
    assert fields["id"] == h.gateway.submitted[0].request_id
    assert (fields["prompt_tokens"], fields["completion_tokens"], fields["ttft_ms"]) == ("-",) * 3
    assert float(fields["total_ms"]) >= 10


async def test_refused_requests(access: Callable[[], list[Line]]) -> None:
    async with harness(max_body_bytes=100) as h:
        await h.client.post("/v1/chat/completions", json=chat_body(temperature=9))
        await h.client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
        await h.client.post("/v1/chat/completions", json=chat_body(pad="x" * 100))
        await h.client.get("/v2/nothing")
    invalid, unknown_model, too_large, missing = access()
    assert (invalid[2]["status"], invalid[2]["id"], invalid[2]["model"]) == ("400", "-", "-")
    assert (unknown_model[2]["status"], unknown_model[2]["model"]) == ("404", "gpt-9")
    assert (too_large[2]["status"], too_large[2]["model"]) == ("413", "-")
    assert missing[:2] == ("GET", "/v2/nothing")
    assert (missing[2]["status"], missing[2]["total_ms"]) == ("404", "-")
