"""What must exist on the bus before the services use it: the streams (as declared in
:mod:`bus.topology`), the object store's bucket and the durables.

The admin makes it (``laneway up`` with bus auth, before its services start; a worker's durable
when its identity is made): no service's own NATS user may, as the server applies a stream's
settings and delivers a consumer's messages past every permission (bus.permissions). On an open
server each service makes what is missing (``bus.client.Bus.provision``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from bus.channels import Consumer, as_declared
from bus.topology import (
    INDEX_SNAPSHOTS,
    INDEX_SNAPSHOTS_MAX_BYTES,
    PLANNER_INTAKE,
    RETIRED_STREAMS,
    STREAM_SUBJECTS,
    bucket_stream,
)

# How long a cluster's servers may take to elect their JetStream meta leader.
META_ELECTION_S = 15.0


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Create or update the streams, stored on ``replicas`` servers (an existing stream moves to
    that count), the object store's bucket and the planners' shared durable; delete retired
    streams. Streams already as declared are only read. While the servers elect their
    JetStream meta leader (a server just restarted), which they answer 503 or not at all, it
    tries again for up to ``META_ELECTION_S``: every step is idempotent."""
    deadline = time.monotonic() + META_ELECTION_S
    while True:
        try:
            return await _ensure_streams(js, replicas)
        except (ServiceUnavailableError, nats.errors.TimeoutError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def _ensure_streams(js: JetStreamContext, replicas: int) -> None:
    missing = []
    for stream, subjects in STREAM_SUBJECTS.items():
        config = stream.config(subjects, replicas)
        try:
            found = await js.stream_info(stream.name)
        except NotFoundError:
            missing.append(config)
            continue
        if not as_declared(found.config, config):
            await js.update_stream(config)
    # After the updates: a subject one of them took from its stream may be a new one's.
    for config in missing:
        with contextlib.suppress(BadRequestError):  # another service made it just now
            await js.add_stream(config)
    for name in RETIRED_STREAMS:
        with contextlib.suppress(NotFoundError):
            await js.stream_info(name)
            await js.delete_stream(name)
    try:
        await js.stream_info(bucket_stream(INDEX_SNAPSHOTS))
    except NotFoundError:
        bucket = ObjectStoreConfig(
            storage=StorageType.FILE, replicas=replicas, max_bytes=INDEX_SNAPSHOTS_MAX_BYTES
        )
        with contextlib.suppress(BadRequestError):
            await js.create_object_store(INDEX_SNAPSHOTS, bucket)
    await ensure_consumer(js, PLANNER_INTAKE)


async def ensure_consumer(js: JetStreamContext, consumer: Consumer[Any]) -> None:
    """Create the durable, or update it to its declared settings."""
    await js.add_consumer(consumer.stream.name, consumer.config())


async def delete_consumer(js: JetStreamContext, consumer: Consumer[Any]) -> None:
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer(consumer.stream.name, consumer.durable)
