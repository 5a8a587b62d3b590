"""What the workers serving each model can do beyond plain generation, learnt from their records
in etcd: a request that asks for such a feature is refused with a 400 naming the engines that
lack it, unless every worker registered for its model has it (the planner may pick any)."""

from __future__ import annotations

from schemas.events import StructuredOutput
from schemas.messages import WorkerRegistration
from services.ingress.errors import InvalidRequest


class WorkerFeatures:
    def __init__(self) -> None:
        # Per served model, the engines of its workers that do no structured outputs, and those
        # that do.
        self._structured: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        engines: dict[str, tuple[set[str], set[str]]] = {}
        for worker in workers.values():
            lacking, able = engines.setdefault(worker.model, (set(), set()))
            (able if worker.structured_outputs else lacking).add(worker.engine)
        self._structured = {
            model: (frozenset(lacking), frozenset(able))
            for model, (lacking, able) in engines.items()
        }

    def check_structured(self, model: str, wanted: StructuredOutput | None) -> None:
        """InvalidRequest where ``wanted`` is asked of a model a worker of which lacks it. With
        no worker registered for the model it goes on: an engine that lacks it refuses it."""
        if wanted is None:
            return
        lacking, able = self._structured.get(model, (frozenset(), frozenset()))
        if lacking:
            beside = f" as well as {', '.join(sorted(able))}" if able else ""
            raise InvalidRequest(
                f"response_format {wanted.type} needs workers whose engine does structured "
                f"outputs (vllm); model '{model}' is served by {', '.join(sorted(lacking))}"
                f"{beside}.",
                "response_format",
            )
