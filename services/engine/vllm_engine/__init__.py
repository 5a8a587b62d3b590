"""vLLM behind Laneway's ``Engine`` protocol (see :mod:`.engine`)."""

from services.engine.vllm_engine.config import VllmEngineConfig
from services.engine.vllm_engine.engine import VllmEngine

__all__ = ["VllmEngine", "VllmEngineConfig"]
