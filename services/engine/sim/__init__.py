"""The simulated engine: vLLM-like scheduling and KV accounting in pure Python, with step times
from a timing model instead of a GPU."""

from services.common.perf_model import DynamoMockerTiming, FixedTiming, TimingModel, timing_preset
from services.engine.scheduling.config import SimConfig
from services.engine.sim.engine import SimEngine

__all__ = [
    "DynamoMockerTiming",
    "FixedTiming",
    "SimConfig",
    "SimEngine",
    "TimingModel",
    "timing_preset",
]
