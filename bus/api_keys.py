"""API keys in etcd: one record per key under ``/laneway/keys/<key_id>``, holding the tenant, its
limits and the SHA-256 of the key; never the key itself, which only its creator ever sees.

A key carries 256 random bits, so an unsalted fast hash is enough: nothing smaller than the key
space can be searched, and the ingress can hash each request's key in microseconds.

A record also names the key's prefix-cache group (its tenant's unless ``cache_group`` names
another) and holds the group's secret, which every key of the group shares: the group's cache
salt is a keyed hash under it (:mod:`schemas.cache_salt`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Literal

import aetcd
from pydantic import BaseModel, ConfigDict, Field

from bus.registry import watch_records
from bus.skipped import Skipped
from schemas.cache_salt import group_salt
from schemas.events import utc_now

KEYS_PREFIX = b"/laneway/keys/"
# What every key starts with, so that a key pasted somewhere it should not be can be found.
KEY_PREFIX = "lw-"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
KEY_ID_PATTERN = r"^[0-9a-f]{16}$"

# admin: load and unload LoRA adapters (services.ingress.adapters).
Scope = Literal["inference", "metrics", "admin"]
SCOPES: tuple[Scope, ...] = ("inference", "metrics", "admin")
# The ingress's admission priorities (services.ingress.admission), highest first.
KeyPriority = Literal["high", "normal", "low"]


class ApiKeyRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str = Field(pattern=KEY_ID_PATTERN)
    tenant: str = Field(pattern=TENANT_PATTERN)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the key, hex")
    rate_per_s: float | None = Field(default=None, gt=0, description="requests per second")
    max_concurrency: int | None = Field(default=None, ge=1, description="requests at once")
    weight: float = Field(
        default=1.0, gt=0, le=1000, description="its share of the cluster under contention"
    )
    tokens_per_minute: int | None = Field(
        default=None, ge=1, description="prompt and completion tokens a minute"
    )
    tokens_per_day: int | None = Field(
        default=None, ge=1, description="prompt and completion tokens a day"
    )
    scopes: tuple[Scope, ...] = Field(default=("inference",), min_length=1)
    max_priority: KeyPriority = Field(
        default="normal", description="the highest admission priority its requests get"
    )
    startup: bool = Field(default=False, description="made by `laneway up` for its own run")
    created_at: datetime = Field(default_factory=utc_now)
    expires_at: datetime | None = Field(
        default=None, description="refused from then on, as if revoked; None: until revoked"
    )
    cache_group: str | None = Field(
        default=None,
        pattern=TENANT_PATTERN,
        description="whose prefix cache its requests share (a tenant's name); None: its tenant's",
    )
    cache_secret: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{32}$",
        description="the cache group's secret, hex, the same in every key of the group; None in "
        "a record made before groups",
    )

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def group(self) -> str:
        return self.cache_group or self.tenant

    def cache_salt(self) -> str:
        """The salt of its requests' block hashes. A record made before groups has no secret:
        its key's own hash stands in (as secret as the group's), so its cache is its own."""
        secret = self.cache_secret or self.sha256
        return group_salt(bytes.fromhex(secret), self.group)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def record_key(key_id: str) -> bytes:
    if not re.fullmatch(KEY_ID_PATTERN, key_id):
        raise ValueError(f"not a key id: {key_id[:40]!r} (16 hex digits)")
    return KEYS_PREFIX + key_id.encode()


async def create_key(
    client: aetcd.Client,
    tenant: str,
    *,
    rate_per_s: float | None = None,
    max_concurrency: int | None = None,
    weight: float = 1.0,
    tokens_per_minute: int | None = None,
    tokens_per_day: int | None = None,
    scopes: tuple[Scope, ...] = ("inference",),
    max_priority: KeyPriority = "normal",
    startup: bool = False,
    expires_in_s: float | None = None,
    cache_group: str | None = None,
) -> tuple[ApiKeyRecord, str]:
    """Store a new key's record; returns it with the key, which is not kept anywhere.
    ``cache_group``: whose prefix cache it shares (a tenant's name); None: its tenant's. The
    group's secret is that of a key already in the group, else a new one."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    now = utc_now()
    group = cache_group or tenant
    known = (r.cache_secret for r in await list_keys(client) if r.group == group)
    cache_secret = next((s for s in known if s is not None), None) or secrets.token_hex(16)
    record = ApiKeyRecord(
        key_id=secrets.token_hex(8),
        tenant=tenant,
        sha256=key_hash(key),
        rate_per_s=rate_per_s,
        max_concurrency=max_concurrency,
        weight=weight,
        tokens_per_minute=tokens_per_minute,
        tokens_per_day=tokens_per_day,
        scopes=scopes,
        max_priority=max_priority,
        startup=startup,
        created_at=now,
        expires_at=None if expires_in_s is None else now + timedelta(seconds=expires_in_s),
        cache_group=None if group == tenant else group,
        cache_secret=cache_secret,
    )
    await client.put(record_key(record.key_id), record.model_dump_json().encode())
    return record, key


async def list_keys(client: aetcd.Client) -> list[ApiKeyRecord]:
    skipped = Skipped("API key")
    stored = await client.get_prefix(KEYS_PREFIX)
    found = (skipped.parse(kv.key, kv.value, _record) for kv in stored)
    return sorted((r for r in found if r is not None), key=lambda r: r.created_at)


async def revoke_key(client: aetcd.Client, key_id: str) -> bool:
    """Delete a key's record; False if there was none."""
    return await client.delete(record_key(key_id)) is not None


async def revoke_startup_keys(client: aetcd.Client) -> None:
    """The keys earlier runs of `laneway up` made for themselves: each run prints a new one."""
    for record in await list_keys(client):
        if record.startup:
            await revoke_key(client, record.key_id)


KeysChanged = Callable[[list[ApiKeyRecord]], Awaitable[None]]


async def watch_keys(client: aetcd.Client, on_change: KeysChanged) -> None:
    """Call ``on_change`` with every live key now and after every change, forever."""

    async def changed(records: dict[bytes, ApiKeyRecord]) -> None:
        await on_change(list(records.values()))

    await watch_records(client, KEYS_PREFIX, "API key", _record, changed)


def _record(key: bytes, value: bytes) -> ApiKeyRecord:
    record = ApiKeyRecord.model_validate_json(value)
    if key != KEYS_PREFIX + record.key_id.encode():
        raise ValueError(f"the record of key {record.key_id!r} is under another key")
    return record
