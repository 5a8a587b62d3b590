"""TensorRT-LLM behind Laneway's step-driven engine protocol (needs ``tensorrt_llm`` at run time,
not at import)."""

from services.engine.trtllm_engine.engine import (
    TrtllmEngine,
    TrtllmEngineConfig,
    TrtllmError,
    open_trtllm,
    sampling_kwargs,
)
from services.engine.trtllm_engine.kv_events import KvEventTranslator

__all__ = [
    "KvEventTranslator",
    "TrtllmEngine",
    "TrtllmEngineConfig",
    "TrtllmError",
    "open_trtllm",
    "sampling_kwargs",
]
