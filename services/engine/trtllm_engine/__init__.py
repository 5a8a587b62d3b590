"""TensorRT-LLM behind Laneway's step-driven engine protocol (needs ``tensorrt_llm`` at run time,
not at import)."""

from services.engine.trtllm_engine.config import TrtllmEngineConfig, TrtllmError
from services.engine.trtllm_engine.engine import TrtllmEngine
from services.engine.trtllm_engine.kv_events import KvEventTranslator
from services.engine.trtllm_engine.llm_api import open_trtllm, sampling_kwargs

__all__ = [
    "KvEventTranslator",
    "TrtllmEngine",
    "TrtllmEngineConfig",
    "TrtllmError",
    "open_trtllm",
    "sampling_kwargs",
]
