"""LoRA adapters loaded through the API, in etcd: one record per adapter under
``/laneway/adapters/<name>``, naming its base model and where workers load it from.

etcd, not an ingress's memory: every ingress replica serves the same adapters (each watches the
prefix), and they outlive any one of them. A worker never reads the records: a request carries
its adapter's name and path (``RequestSpec.lora``, ``lora_path``), so that an adapter unloaded
and loaded again from elsewhere is never served from its old path by a worker that missed the
change.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime

import aetcd
from pydantic import BaseModel, ConfigDict, Field

from bus.registry import watch_records
from schemas.events import utc_now

ADAPTERS_PREFIX = b"/laneway/adapters/"
# A served name as clients write it in ``model``, and an etcd key: no spaces, no control
# characters; ``/`` and ``:`` as in Hugging Face names (``org/name``) and tags.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}$"
MAX_PATH_CHARS = 4096


class AdapterRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=ADAPTER_NAME_PATTERN)
    base_model: str = Field(min_length=1, max_length=256, description="the model it adapts")
    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS, description="where workers load it")
    created_at: datetime = Field(default_factory=utc_now)


def adapter_key(name: str) -> bytes:
    return ADAPTERS_PREFIX + name.encode()


async def add_adapter(client: aetcd.Client, record: AdapterRecord) -> bool:
    """Store ``record`` unless an adapter of its name is there; False if one was."""
    key = adapter_key(record.name)
    tx = client.transactions
    won, _ = await client.transaction(
        compare=[tx.create(key) == 0],
        success=[tx.put(key, record.model_dump_json().encode())],
        failure=[],
    )
    return bool(won)


async def remove_adapter(client: aetcd.Client, name: str) -> bool:
    """Delete the adapter's record; False if there was none."""
    return await client.delete(adapter_key(name)) is not None


AdaptersChanged = Callable[[list[AdapterRecord]], Awaitable[None]]


async def watch_adapters(client: aetcd.Client, on_change: AdaptersChanged) -> None:
    """Call ``on_change`` with every adapter now and after every change, forever."""

    async def changed(records: dict[bytes, AdapterRecord]) -> None:
        await on_change(sorted(records.values(), key=lambda r: r.name))

    await watch_records(client, ADAPTERS_PREFIX, "LoRA adapter", _record, changed)


def _record(key: bytes, value: bytes) -> AdapterRecord:
    record = AdapterRecord.model_validate_json(value)
    if key != adapter_key(record.name):
        raise ValueError(f"the record of adapter {record.name!r} is under another key")
    return record
