"""What Laneway asks of TensorRT-LLM's LLM API: starting an ``LLM`` for a model directory, and
the sampling arguments of a request. ``tensorrt_llm`` is imported only when an ``LLM`` starts."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from schemas.events import SamplingParams
from services.engine.trtllm_engine.config import TrtllmEngineConfig

# Starts TensorRT-LLM for a config and a sequence length: the ``LLM`` and its ``SamplingParams``
# class. Tests pass a stand-in.
LlmOpener = Callable[[TrtllmEngineConfig, int], tuple[Any, Callable[..., Any]]]


def open_trtllm(config: TrtllmEngineConfig, max_seq_len: int) -> tuple[Any, Callable[..., Any]]:
    """Start TensorRT-LLM on ``config.model_dir``; returns the ``LLM`` and its
    ``SamplingParams`` class."""
    from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams as TrtSamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    kv_cache_config = KvCacheConfig(
        enable_block_reuse=True,
        tokens_per_block=config.block_size,
        max_tokens=config.kv_cache_max_tokens,
        free_gpu_memory_fraction=config.free_gpu_memory_fraction,
        event_buffer_max_size=config.event_buffer_max_size if config.kv_events else 0,
    )
    llm = LLM(
        model=str(config.model_dir),
        # Laneway tokenizes at ingress and detokenizes in the worker.
        skip_tokenizer_init=True,
        kv_cache_config=kv_cache_config,
        max_batch_size=config.max_num_seqs,
        max_num_tokens=config.max_num_batched_tokens,
        max_seq_len=max_seq_len,
        enable_chunked_prefill=True,
    )
    return llm, TrtSamplingParams


def sampling_kwargs(
    sampling: SamplingParams, eos_token_id: int, request_id: str
) -> dict[str, object]:
    """TensorRT-LLM ``SamplingParams`` arguments for Laneway's sampling settings. Stop strings
    are left out: the worker cuts them from the text and aborts the request."""
    seed = sampling.seed
    if seed is None:
        # Without a seed every request would sample with TensorRT-LLM's default seed 0;
        # crc32, not hash(), so that a request id always means the same seed.
        seed = zlib.crc32(request_id.encode())
    kwargs: dict[str, object] = {
        "max_tokens": sampling.max_tokens,
        "end_id": eos_token_id,
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "seed": seed,
        "detokenize": False,
    }
    if sampling.temperature == 0.0:
        # TensorRT-LLM decodes greedily when sampling is restricted to the top token.
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = sampling.temperature
        kwargs["top_p"] = sampling.top_p
    return kwargs


def max_positions(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return int(config["max_position_embeddings"])
