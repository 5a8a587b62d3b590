"""The workers' settings of the vLLM end-to-end clusters."""

from __future__ import annotations

import json
from pathlib import Path

from infra.engine_env import engine_env


def vllm_env(model: Path) -> dict[str, str]:
    """`laneway up --engine vllm`'s, with a small KV cache (64 MiB: 16,384 tokens of the tiny
    model) and no torch.compile: its warm-up took 67 s of a worker's 85 s start on 2 loaded cores
    (the model folder is new each run, so its compile cache misses), and no test here times
    steps."""
    return {
        **engine_env("vllm", model),
        "LANEWAY_KV_CACHE_GIB": "0.0625",
        "LANEWAY_VLLM_ARGS": json.dumps({"enforce_eager": True}),
    }
