"""What Laneway adds to the engine: one tiny checkpoint served by vLLM's own OpenAI server
(:mod:`benchmarks.vllm_server`), then by `laneway up --engine vllm --workers 1`, taking turns in
one run, measured by the same streaming client (:mod:`infra.bench.load_client`) at c=1 and c=8:
TTFT p50, ITL p50 and requests per second, and Laneway's ratios to vLLM's, medians over the
rounds. Both run vLLM with the same settings: bfloat16 (vLLM's choice for this float32 checkpoint
on a CPU; a Laneway worker's default is float32), block size 32, eager mode, a 1 GiB KV cache.

    python -m benchmarks.overhead [--rounds 3 --max-tokens 64]   (make bench-overhead)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.live_cluster import laneway_up
from infra.bench.load_client import LoadSpec, run_load
from infra.ports import free_port
from services.engine.torch_engine.tiny import make_tiny_model

KV_CACHE_GIB = 1
DTYPE = "bfloat16"
FIELDS = ("ttft_ms_p50", "itl_ms_p50", "rps")
_START_S = 240.0


@contextlib.contextmanager
def vllm_alone(model: Path) -> Iterator[str]:
    """vLLM's OpenAI server on a free port; its base URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "benchmarks.vllm_server", "--model", str(model),
        "--port", str(port), "--dtype", DTYPE, "--block-size", "32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30), "--disable-log-stats",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}/v1"
        try:
            deadline = time.monotonic() + _START_S
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(f"vLLM's server did not start:\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/models", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def laneway(model: Path) -> Iterator[tuple[str, str | None]]:
    """`laneway up --engine vllm --workers 1` on the same checkpoint; its base URL and key."""
    extra = ("--engine", "vllm", "--model", str(model))
    env = {
        "LANEWAY_KV_CACHE_GIB": str(KV_CACHE_GIB),
        "LANEWAY_BLOCK_SIZE": "32",
        "LANEWAY_DTYPE": DTYPE,
        "LANEWAY_VLLM_ARGS": json.dumps({"enforce_eager": True}),
    }
    with laneway_up(workers=1, speedup=1.0, extra_args=extra, env=env) as up:
        yield up.base_url, up.api_key


def measure(
    base_url: str, model: str, api_key: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    """The client's figures at c=1 and c=8."""
    out: dict[str, Any] = {}
    for concurrency, requests in ((1, args.requests_c1), (8, args.requests_c8)):
        spec = LoadSpec(
            base_url=base_url,
            model=model,
            api_key=api_key,
            concurrency=concurrency,
            requests=requests,
            warmup=3,
            max_tokens=args.max_tokens,
        )
        result = asyncio.run(run_load(spec))
        if result["errors"]:
            raise RuntimeError(f"errors at c={concurrency}: {result['error_kinds']}")
        out[f"c{concurrency}"] = {field: result[field] for field in FIELDS}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-c1", type=int, default=20)
    parser.add_argument("--requests-c8", type=int, default=80)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"vllm": [], "laneway": []}
    with tempfile.TemporaryDirectory(prefix="lw-overhead-") as folder:
        model = Path(folder) / "tiny"
        make_tiny_model(model)
        for round_ in range(args.rounds):
            # Taking turns: neither side always runs on a machine the other just warmed.
            order = ("vllm", "laneway") if round_ % 2 == 0 else ("laneway", "vllm")
            for side in order:
                if side == "vllm":
                    with vllm_alone(model) as base:
                        figures = measure(base, str(model), None, args)
                else:
                    with laneway(model) as (base, key):
                        figures = measure(base, model.name, key, args)
                runs[side].append(figures)
                print(json.dumps({"round": round_ + 1, "side": side, **figures}), flush=True)
    summary: dict[str, Any] = {}
    for c in ("c1", "c8"):
        for field in FIELDS:
            medians = {s: statistics.median(r[c][field] for r in runs[s]) for s in runs}
            summary[f"{c}_{field}"] = {**medians, "ratio": medians["laneway"] / medians["vllm"]}
    print(json.dumps({"medians": summary, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
