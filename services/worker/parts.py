"""The worker's parts that its sides share: wired once in the runtime, handed to each."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.driver import EngineDriver
from services.worker.handoff import KvReceiver
from services.worker.outputs import Background, Outputs
from services.worker.requests import Requests


@dataclass(frozen=True)
class WorkerParts:
    """What a request's handling reaches for on any side: the requests held, the KV arriving,
    the engine's driver, what goes out, and the tasks that outlive a handler."""

    requests: Requests
    receiver: KvReceiver
    driver: EngineDriver
    outputs: Outputs
    background: Background
