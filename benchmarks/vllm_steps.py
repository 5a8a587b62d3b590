"""How long vLLM's in-process engine takes a step on the thread that built it and on another
thread, as a Laneway worker steps it (:mod:`services.worker.driver`): on some CPUs OpenMP runs a
built thread's steps much faster (docs/performance.md, `make bench-overhead`).

    python -m benchmarks.vllm_steps [--batch 8 --tokens 64]

Builds a ``make-tiny-model`` checkpoint (bfloat16, block size 32, eager, 1 GiB of KV, as
`make bench-overhead` does), then runs three rounds of ``--batch`` requests of ``--tokens``
tokens each way and prints the median step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.engine.torch_engine.tiny import make_tiny_model
from services.engine.vllm_engine.compat import import_vllm


def build(model: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    arguments = EngineArgs(
        model=str(model),
        block_size=32,
        dtype="bfloat16",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        disable_log_stats=True,
    )
    return LLMEngine.from_engine_args(arguments)


def step_ms(engine: Any, label: str, batch: int, tokens: int) -> float:
    """The median step of three rounds of ``batch`` requests of ``tokens`` tokens each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    steps = []
    for round_ in range(3):
        for i in range(batch):
            prompt = TokensPrompt(prompt_token_ids=list(range(5 + i, 100 + i)))
            sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
            engine.add_request(f"{label}-{round_}-{i}", prompt, sampling)
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_steps", description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    # The engine core in this process, as a worker runs it.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import_vllm()
    other = ThreadPoolExecutor(1)
    with tempfile.TemporaryDirectory(prefix="lw-steps-") as folder:
        model = Path(folder) / "tiny"
        make_tiny_model(model)
        engine = build(model)
        built = step_ms(engine, "built", args.batch, args.tokens)
        stepped = other.submit(step_ms, engine, "other", args.batch, args.tokens).result()
    print(f"step ms, {args.batch} requests: on the building thread {built:.2f}, "
          f"on another {stepped:.2f} (ratio {stepped / built:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
