"""Issue 36's finding 3, on a real cluster with Laneway's auth on: only the planner starts an
attempt. A worker could publish a request's `RouteDecided` with a higher attempt to another
worker's route subject (it might, for hand-offs), and the victim aborted its real attempt: 46
characters of a 400-token answer, then a 502. Routes now come from the planner alone, and a
prefill worker's hand-off travels on a subject naming it, taken only from the prefill worker the
route named: the same attack is refused, a forged hand-off dropped, and the answer is exact."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import nats
import pytest

from bus.credentials import Credentials, inbox_prefix, split_credentials
from bus.topology import Subjects
from schemas.codec import encode
from schemas.events import PrefillCompleted, RouteDecided
from tests.helpers import eventually
from tests.live import ClusterFactory, Observed, observe, registrations

pytestmark = pytest.mark.live

MODEL = "laneway-sim"
TOKENS = 400
# Every prompt prefilled remotely; a decode step of 2 ms, so that the answer streams ~1 s.
DISAGG = {"LANEWAY_DISAGG": "always", "LANEWAY_HANDOFF_TIMEOUT_S": "2", "LANEWAY_SPEEDUP": "0.5"}


async def test_a_worker_cannot_end_or_restart_another_workers_attempt(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(workers=2, prefill_workers=1, env=DISAGG)
    observer, seen = await observe(cluster.nats_url)
    workers = await registrations(cluster.etcd_endpoints)
    headers = cluster.api_headers
    body = {"model": MODEL, "prompt": "a long answer, please", "max_tokens": TOKENS, "seed": 7}
    refusals: list[str] = []

    async def on_error(error: Exception) -> None:
        refusals.append(str(error).lower())

    async with httpx.AsyncClient(base_url=cluster.config.base_url, timeout=60) as http:
        control = (await http.post("/completions", json=body, headers=headers)).json()
        expected = control["choices"][0]["text"]
        assert len(expected) == TOKENS
        streamed = ""
        async with http.stream(
            "POST", "/completions", json={**body, "stream": True}, headers=headers
        ) as reply:
            lines = reply.aiter_lines()
            streamed += await _text_of_next(lines)
            routes = await eventually(lambda: _routes(seen, skip=1), message="no route seen")
            route = routes[-1]
            victim = route.worker_id
            attacker = next(w for w, r in workers.items() if r.role != "prefill" and w != victim)
            creds = Credentials.read(
                cluster.config.state_dir / "auth/nats" / f"worker-{attacker}.json"
            )
            raw = await nats.connect(
                creds.within(split_credentials(cluster.nats_url)[1]),
                error_cb=on_error,
                inbox_prefix=inbox_prefix(creds.user),
            )
            try:
                # A new attempt of the victim's request, on the victim's route subject.
                again = route.model_copy(
                    update={
                        "event_id": "forged-route",
                        "spec": route.spec.model_copy(update={"attempt": route.spec.attempt + 10}),
                    }
                )
                await raw.publish(Subjects.route(victim).subject, encode(again))
                # A hand-off under its own name that ends the request's prefill as failed.
                forged = PrefillCompleted(
                    source=f"worker/{attacker}",
                    request_id=route.request_id,
                    worker_id=attacker,
                    decode_worker_id=victim,
                    prefilled_tokens=0,
                    error="forged",
                )
                await raw.publish(Subjects.prefilled(victim, attacker).subject, encode(forged))
                await raw.flush()
                await eventually(
                    lambda: any(Subjects.route(victim).subject in r for r in refusals),
                    message="the forged route was not refused",
                )
            finally:
                await raw.close()
            async for line in lines:
                streamed += _text(line)
    await observer.close()
    assert streamed == expected
    attempts = {r.spec.attempt for r in _routes(seen, skip=1) if r.request_id == route.request_id}
    assert attempts == {route.spec.attempt}


def _routes(seen: Observed, skip: int) -> list[RouteDecided]:
    """The decisions seen so far, past the first ``skip`` requests' (the control's)."""
    found = [e for e in seen.events["RouteDecided"] if isinstance(e, RouteDecided)]
    ids = list(dict.fromkeys(r.request_id for r in found))
    return [r for r in found if r.request_id in ids[skip:]]


async def _text_of_next(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        text = _text(line)
        if text:
            return text
    raise AssertionError("the stream ended before its first token")


def _text(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    return "".join(c["text"] for c in json.loads(line[6:])["choices"])
