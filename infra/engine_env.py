"""The workers' settings an engine choice implies (`laneway up --engine`, `laneway bench --mode
live --engine`): the engine, its model folder and name, and the cache and batch that suit it."""

from __future__ import annotations

import json
from pathlib import Path

# vLLM's CPU attention takes blocks of a multiple of 32 tokens: the ingress hashes prompts at the
# workers' size, so the whole cluster takes it. A GiB of host memory holds the tiny model's KV
# (4 KiB a token in float32) for about 260,000 tokens.
VLLM_ENV = {"LANEWAY_BLOCK_SIZE": "32", "LANEWAY_KV_CACHE_GIB": "1"}


def engine_env(engine: str, model: Path | None, command: str = "laneway up") -> dict[str, str]:
    """``LANEWAY_*`` of every worker for ``engine``; SystemExit, its message naming
    ``command``, where the model folder does not fit the engine."""
    if engine == "sim":
        if model is not None:
            raise SystemExit(
                f"{command}: --model is for --engine torch, trtllm or vllm; the sim engine serves "
                "'laneway-sim' and counts one token per UTF-8 byte"
            )
        return {}
    if model is None or not (model / "config.json").exists():
        raise SystemExit(f"{command}: --engine {engine} needs --model DIR with a config.json")
    name = model.resolve().name
    return {
        "LANEWAY_ENGINE": engine,
        "LANEWAY_MODEL_DIR": str(model.resolve()),
        "LANEWAY_MODEL": name,
        "LANEWAY_SERVED_MODEL_NAMES": json.dumps([name]),
        # A small CPU model: a modest cache and batch suit it.
        "LANEWAY_NUM_GPU_BLOCKS": "1024",
        "LANEWAY_MAX_NUM_SEQS": "32",
        "LANEWAY_MAX_NUM_BATCHED_TOKENS": "2048",
        **(VLLM_ENV if engine == "vllm" else {}),
    }
