"""The simulated engine: vLLM-like scheduling and KV accounting in pure Python, with step times
from a timing model instead of a GPU."""

from services.engine.sim.config import SimConfig
from services.engine.sim.engine import SimEngine
from services.engine.sim.timing import DynamoMockerTiming, FixedTiming, TimingModel, timing_preset

__all__ = [
    "DynamoMockerTiming",
    "FixedTiming",
    "SimConfig",
    "SimEngine",
    "TimingModel",
    "timing_preset",
]
