"""LoRA adapters loaded at run time, with vLLM's API: ``POST /v1/load_lora_adapter``
(``lora_name``, ``lora_path``, and ``base_model_name`` where the cluster serves several models)
and ``POST /v1/unload_lora_adapter`` (``lora_name``). A request names an adapter as its
``model``; ``/v1/models`` lists them with ``parent`` set to their base model.

The ingress only records an adapter (in etcd, :mod:`bus.adapters`, so that every replica serves
it): workers load it on demand from its path, before the first request for it runs there (a real
engine's error then fails that request with its reason). So a path is not checked here,
where the workers' file systems are not to be seen; a key with the ``admin`` scope is needed
where the API takes keys.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from bus.adapters import ADAPTER_NAME_PATTERN, MAX_PATH_CHARS, AdapterRecord
from services.ingress.access_log import log_request
from services.ingress.body import read_json_body, request_headers
from services.ingress.errors import ApiError, InvalidRequest
from services.ingress.json_fields import check_length, json_object, required, type_error
from services.ingress.openai_models import MAX_MODEL_CHARS

# A load's body is a name and a path; anything much larger is not one.
_MAX_BODY_BYTES = 16 * 1024
_JSON = "application/json"

AddAdapter = Callable[[AdapterRecord], Awaitable[bool]]
"""Store an adapter unless one of its name is there (False then)."""
RemoveAdapter = Callable[[str], Awaitable[bool]]
"""Forget an adapter; False if there was none."""


class Adapters:
    """The adapters this ingress serves, as etcd has them (``on_adapters``, from its watch), and
    ``/v1/models``' entries for them."""

    def __init__(self) -> None:
        self._by_name: dict[str, AdapterRecord] = {}
        self.version = 0
        """Bumped on every change: what is built from the adapters is built again."""
        self.read = asyncio.Event()
        """Set once etcd's adapters are in: a replica serves no request before."""

    async def on_adapters(self, records: Sequence[AdapterRecord]) -> None:
        self._by_name = {record.name: record for record in records}
        self.version += 1
        self.read.set()

    def added(self, record: AdapterRecord) -> None:
        """This replica stored ``record``: served at once, not only once its watch says so."""
        self._by_name[record.name] = record
        self.version += 1

    def removed(self, name: str) -> None:
        if self._by_name.pop(name, None) is not None:
            self.version += 1

    def find(self, name: str) -> AdapterRecord | None:
        return self._by_name.get(name)

    def model_entries(self) -> list[dict[str, Any]]:
        """OpenAI model objects, with vLLM's ``parent``. Not vLLM's ``root`` (the adapter's
        path): every key with the inference scope lists models."""
        return [
            {
                "id": record.name,
                "object": "model",
                "created": int(record.created_at.timestamp()),
                "owned_by": "laneway",
                "parent": record.base_model,
            }
            for record in self._by_name.values()
        ]


class AdapterEndpoints:
    """The two admin endpoints, over the served models ``models`` and etcd's records."""

    def __init__(
        self,
        adapters: Adapters,
        models: Sequence[str],
        add: AddAdapter,
        remove: RemoveAdapter,
    ) -> None:
        self.adapters = adapters
        self._models = tuple(models)
        self._add = add
        self._remove = remove

    async def load(self, request: Request) -> Response:
        try:
            data = await _json(request)
            name = _name(data)
            if name in self._models:
                raise InvalidRequest(f"'{name}' is a served model's name.", "lora_name")
            path = _string(data, "lora_path", MAX_PATH_CHARS)
            record = AdapterRecord(name=name, base_model=self._base_model(data), path=path)
            if not await self._add(record):
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", None)
        except ApiError as error:
            return _error(request, error)
        self.adapters.added(record)
        log_request(request.scope, 200, model=name)
        return _success(f"LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            data = await _json(request)
            name = _string(data, "lora_name", MAX_MODEL_CHARS)
            if not await self._remove(name):
                raise ApiError(
                    404,
                    f"The lora adapter '{name}' cannot be found.",
                    param="lora_name",
                    code="model_not_found",
                )
        except ApiError as error:
            return _error(request, error)
        self.adapters.removed(name)
        log_request(request.scope, 200, model=name)
        return _success(f"LoRA adapter '{name}' removed successfully.")

    def _base_model(self, data: dict[str, Any]) -> str:
        models = self._models
        given = data.get("base_model_name")
        if given is None:
            if len(models) == 1:
                return models[0]
            raise InvalidRequest(
                "Missing required parameter: 'base_model_name' (this cluster serves "
                f"{', '.join(models)}).",
                "base_model_name",
            )
        base = _string(data, "base_model_name", MAX_MODEL_CHARS)
        if base not in models:
            raise InvalidRequest(
                f"The model `{base}` is not served here (served: {', '.join(models)}).",
                "base_model_name",
                code="model_not_found",
            )
        return base


def _name(data: dict[str, Any]) -> str:
    name = _string(data, "lora_name", MAX_MODEL_CHARS)
    if not re.fullmatch(ADAPTER_NAME_PATTERN, name):
        raise InvalidRequest(
            "Invalid 'lora_name': at most 128 letters, digits and _ . : / @ + -, starting with a "
            "letter or digit.",
            "lora_name",
        )
    return name


def _string(data: dict[str, Any], name: str, limit: int) -> str:
    value = required(data, name)
    if not isinstance(value, str):
        raise type_error(name, "a string", value)
    check_length(name, value, limit)
    if not value:
        raise InvalidRequest(f"Invalid '{name}': empty.", name)
    return value


async def _json(request: Request) -> dict[str, Any]:
    body = await read_json_body(request_headers(request.scope), request.receive, _MAX_BODY_BYTES)
    return json_object(body)


def _success(message: str) -> Response:
    # vLLM answers a load or unload with this sentence as plain text.
    return Response(f"Success: {message}", media_type="text/plain")


def _error(request: Request, error: ApiError) -> Response:
    log_request(request.scope, error.status)
    return Response(error.body(), status_code=error.status, media_type=_JSON)
