"""The live load client against a small real SSE server: what it counts as a token, a gap, an
error, and the bench's table of ratios."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from benchmarks.bench_live import Target, format_table, loads, run_all
from infra.bench.load_client import LoadSpec, first_model, percentile, run_load

KEY = "lw-test-key"


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _chat(request: web.Request) -> web.StreamResponse:
    if request.headers.get("Authorization") != f"Bearer {KEY}":
        return web.json_response({"error": {"message": "no key"}}, status=401)
    body = await request.json()
    mode = body["messages"][0]["content"][:4]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_event({"choices": [{"delta": {"role": "assistant"}}]}))
    # "notx": no text at all, as Dynamo's mocker streams.
    for i in range(0 if mode == "notx" else body["max_tokens"]):
        await asyncio.sleep(0.01)
        # One event split across two writes: the client must reassemble the line.
        data = _event({"choices": [{"delta": {"content": f"t{i}"}}]})
        await response.write(data[:7])
        await response.write(data[7:])
    if mode == "fail":
        await response.write(_event({"error": {"message": "boom"}}))
    usage = {"completion_tokens": body["max_tokens"], "prompt_tokens": 3}
    await response.write(_event({"choices": [], "usage": usage}))
    if mode != "trun":
        await response.write(b"data: [DONE]\n\n")
    return response


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "tiny"}, {"id": "other"}]})


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_counts_text_chunks_gaps_and_rate(server: str) -> None:
    spec = LoadSpec(server, "tiny", KEY, concurrency=2, requests=6, warmup=1, max_tokens=4)
    out = await run_load(spec)
    assert (out["sent"], out["ok"], out["errors"]) == (6, 6, 0)
    assert out["mean_chunks"] == 4 and out["mean_completion_tokens"] == 4
    assert out["ttft_without_text"] == 0
    # The role-only first event is no token: the first text comes a sleep later.
    assert 8 <= out["ttft_ms_p50"] < out["lat_ms_p50"]
    assert 8 <= out["itl_ms_p50"] < 200
    assert out["rps"] == pytest.approx(6 / out["elapsed_s"], rel=0.01)


async def test_errors_by_kind(server: str) -> None:
    no_key = await run_load(LoadSpec(base_url=server + "/v1", model="tiny", requests=2, warmup=0))
    assert no_key["errors"] == 2
    assert list(no_key["error_kinds"]) == ['HTTP 401: {"error": {"message": "no key"}}']
    for prefix, kind in (("fail", "error event"), ("trun", "stream ended without [DONE]")):
        content = {"messages": [{"role": "user", "content": prefix + " x"}]}
        out = await run_load(
            LoadSpec(base_url=server, model="tiny", api_key=KEY, requests=1, extra=content)
        )
        assert out["ok"] == 0 and next(iter(out["error_kinds"])).startswith(kind)


async def test_duration_window_counts_requests_ended_inside(server: str) -> None:
    spec = LoadSpec(server, "tiny", KEY, concurrency=3, duration_s=0.5, warmup=0)
    out = await run_load(spec)
    # About 90 ms a request: a few rounds of 3 streams, and the last ones drained past 0.5 s.
    assert out["window_s"] == 0.5 and out["ok"] == out["sent"] >= 6
    assert out["rps"] * 0.5 <= out["ok"]
    assert await first_model(server, None) == "tiny"


async def test_ttft_of_a_stream_without_text_is_its_first_event(server: str) -> None:
    content = {"messages": [{"role": "user", "content": "notx"}]}
    spec = LoadSpec(server, "tiny", KEY, requests=3, warmup=0, extra=content)
    out = await run_load(spec)
    assert out["ok"] == 3 and out["ttft_without_text"] == 3 and out["mean_chunks"] == 0
    assert 0 < out["ttft_ms_p50"] < out["lat_ms_p50"]
    assert out["itl_ms_p50"] is None


async def test_bench_takes_turns_and_counts_cpu_of_known_processes(server: str) -> None:
    # This process serves the test server: its CPU is what a request cost "it".
    served_here = Target("here", server, KEY, (os.getpid(),))
    unknown = Target("there", server, KEY)
    shape = loads(seq_requests=3, duration_s=0.3)
    results = await run_all([served_here, unknown], {"seq": shape["seq"]}, rounds=2)
    assert [(r["system"], r["round"]) for r in results] == [
        ("here", 0),
        ("there", 0),
        ("here", 1),
        ("there", 1),
    ]
    assert all(r["ok"] == 3 and r["model"] == "tiny" for r in results)
    assert all(r["cpu_ms_per_request"] > 0 for r in results if r["system"] == "here")
    assert all(r["cpu_ms_per_request"] is None for r in results if r["system"] == "there")


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_table_medians_and_ratios() -> None:
    def run(system: str, rps: float, lat: float) -> dict[str, object]:
        cols = ("ttft_ms_p50", "ttft_ms_p99", "lat_ms_p50", "lat_ms_p99", "itl_ms_p95")
        return {"system": system, "load": "c32", "rps": rps, "errors": 0} | dict.fromkeys(cols, lat)

    results = [run("dyn", 100, 10), run("lw", 40, 30), run("dyn", 300, 10), run("lw", 60, 20)]
    lines = format_table(results).splitlines()
    assert lines[1].split()[:3] == ["c32", "dyn", "200.00"]
    assert lines[2].split()[:3] == ["c32", "lw", "50.00"]
    assert lines[3].split()[:3] == ["ratio", "0.25", "2.50"]
