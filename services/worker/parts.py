"""The worker's parts that its sides share: wired once in the runtime, handed to each."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace

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


class WorkerSide:
    """A side of the worker's request handling (decode, KV moves): the shared parts at hand,
    and spans in the worker's tracer."""

    def __init__(self, parts: WorkerParts) -> None:
        self._requests = parts.requests
        self._receiver = parts.receiver
        self._driver = parts.driver
        self._outputs = parts.outputs
        self._background = parts.background
        self._tracer = trace.get_tracer("laneway.worker")
