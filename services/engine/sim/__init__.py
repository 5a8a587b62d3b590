"""The simulated engine: vLLM-like scheduling and KV accounting in pure Python, with step times
from a perf model instead of a GPU."""

from services.common.perf_model import DynamoMockerPerf, FixedPerf, PerfModel, perf_model
from services.engine.scheduling.config import SimConfig
from services.engine.sim.engine import SimEngine

__all__ = [
    "DynamoMockerPerf",
    "FixedPerf",
    "PerfModel",
    "SimConfig",
    "SimEngine",
    "perf_model",
]
