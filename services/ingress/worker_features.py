"""What the workers serving each model can do beyond plain generation (structured outputs, log
probabilities), learnt from their records in etcd: a request that asks for such a feature is
refused with a 400 naming the engines that lack it, unless every worker registered for its model
has it (the planner may pick any)."""

from __future__ import annotations

from collections.abc import Callable

from schemas.events import StructuredOutput
from schemas.messages import WorkerRegistration
from services.ingress.errors import InvalidRequest


class WorkerFeatures:
    def __init__(self) -> None:
        # Per served model, the engines of its workers that do no structured outputs, and those
        # that do.
        self._structured: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        # The same for log probabilities, and for LoRA adapters.
        self._logprobs: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._adapters: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    async def on_workers(self, workers: dict[str, WorkerRegistration]) -> None:
        self._structured = _engines(workers, lambda w: w.structured_outputs)
        self._logprobs = _engines(workers, lambda w: w.logprobs)
        self._adapters = _engines(workers, lambda w: w.max_loras > 0)

    def check_structured(self, model: str, wanted: StructuredOutput | None) -> None:
        """InvalidRequest where ``wanted`` is asked of a model a worker of which lacks it. With
        no worker registered for the model it goes on: an engine that lacks it refuses it."""
        if wanted is None:
            return
        _refuse(
            self._structured,
            model,
            f"response_format {wanted.type} needs workers whose engine does structured outputs",
            "response_format",
        )

    def check_logprobs(self, model: str, top: int | None) -> None:
        """InvalidRequest where log probabilities (``top``: not None) are asked of a model a
        worker of which gives none."""
        if top is not None:
            need = "logprobs need workers whose engine gives them"
            _refuse(self._logprobs, model, need, "logprobs")

    def check_adapters(self, model: str) -> None:
        """InvalidRequest where none of ``model``'s workers serves LoRA adapters; the planner
        routes an adapter's requests only to those that do."""
        lacking, able = self._adapters.get(model, (frozenset(), frozenset()))
        if lacking and not able:
            raise InvalidRequest(
                f"Model '{model}' is served by workers that hold no LoRA adapters: start them "
                "with --max-loras N (LANEWAY_MAX_LORAS) on an engine that serves adapters (sim, "
                "vllm).",
                "model",
            )


def _engines(
    workers: dict[str, WorkerRegistration], has: Callable[[WorkerRegistration], bool]
) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Per served model, the engines of its workers that lack a feature, and those that have it."""
    engines: dict[str, tuple[set[str], set[str]]] = {}
    for worker in workers.values():
        lacking, able = engines.setdefault(worker.model, (set(), set()))
        (able if has(worker) else lacking).add(worker.engine)
    return {
        model: (frozenset(lacking), frozenset(able)) for model, (lacking, able) in engines.items()
    }


def _refuse(
    engines: dict[str, tuple[frozenset[str], frozenset[str]]], model: str, need: str, param: str
) -> None:
    lacking, able = engines.get(model, (frozenset(), frozenset()))
    if lacking:
        beside = f" as well as {', '.join(sorted(able))}" if able else ""
        raise InvalidRequest(
            f"{need} (vllm); model '{model}' is served by {', '.join(sorted(lacking))}{beside}.",
            param,
        )
