"""A real engine: a Llama-layout transformer in PyTorch behind the step-driven ``Engine`` protocol,
scheduled by ``sim``'s scheduler over a paged, prefix-cached KV cache."""

from services.engine.torch_engine.config import TorchEngineConfig
from services.engine.torch_engine.engine import TorchEngine
from services.engine.torch_engine.export import KvExport, KvLayout
from services.engine.torch_engine.model import LlamaConfig, LlamaForCausalLM, load_model

__all__ = [
    "KvExport",
    "KvLayout",
    "LlamaConfig",
    "LlamaForCausalLM",
    "TorchEngine",
    "TorchEngineConfig",
    "load_model",
]
