"""Bulk bytes over core NATS: a payload cut into chunks, checked whole on arrival.

For a prompt's KV tensors on their way from a prefill worker to a decode worker. They are not
events (megabytes, useless once delivered), so they travel outside JetStream; the event that
announces them (``PrefillCompleted``) carries the chunk count, size and checksum, and the
receiver uses the payload only if all of it arrived intact. Anything else is a failed hand-off,
which the decode worker answers with a local prefill.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from schemas.events import KvPayload

BLOB_ID_HEADER = "Laneway-Blob"
CHUNK_HEADER = "Laneway-Chunk"
# Below the server's default 1 MiB max payload, with room for headers.
CHUNK_BYTES = 512 * 1024

Publish = Callable[[str, bytes, dict[str, str]], Awaitable[None]]


def describe(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> KvPayload:
    return KvPayload(
        chunks=max(1, -(-len(data) // chunk_bytes)),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


async def send_blob(
    publish: Publish, subject: str, blob_id: str, data: bytes, chunk_bytes: int = CHUNK_BYTES
) -> KvPayload:
    payload = describe(data, chunk_bytes)
    for i in range(payload.chunks):
        chunk = data[i * chunk_bytes : (i + 1) * chunk_bytes]
        await publish(subject, chunk, {BLOB_ID_HEADER: blob_id, CHUNK_HEADER: str(i)})
    return payload


@dataclass
class _Partial:
    started: float
    chunks: dict[int, bytes] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class BlobAssembler:
    """Collects chunks by blob id until their payload is claimed; forgets unclaimed blobs after
    ``max_age_s`` (a hand-off the receiver already gave up on)."""

    def __init__(self, max_age_s: float = 60.0) -> None:
        self._max_age_s = max_age_s
        self._partial: dict[str, _Partial] = {}

    def add(self, blob_id: str, index: int, chunk: bytes) -> None:
        now = time.monotonic()
        for stale in [b for b, p in self._partial.items() if now - p.started > self._max_age_s]:
            del self._partial[stale]
        partial = self._partial.setdefault(blob_id, _Partial(now))
        partial.chunks[index] = chunk
        partial.arrived.set()

    async def on_msg(self, msg: Msg) -> None:
        headers = msg.headers or {}
        blob_id, index = headers.get(BLOB_ID_HEADER), headers.get(CHUNK_HEADER)
        if blob_id is not None and index is not None and index.isdigit():
            self.add(blob_id, int(index), msg.data)

    async def take(self, blob_id: str, payload: KvPayload, timeout_s: float) -> bytes:
        """The whole payload, once every chunk is here; raises ``ValueError`` if it is not
        complete within ``timeout_s`` or does not match its checksum."""
        deadline = time.monotonic() + timeout_s
        partial = self._partial.setdefault(blob_id, _Partial(time.monotonic()))
        try:
            while len(partial.chunks) < payload.chunks:
                partial.arrived.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"{len(partial.chunks)} of {payload.chunks} KV chunks arrived")
                try:
                    await asyncio.wait_for(partial.arrived.wait(), left)
                except TimeoutError:
                    continue
            data = b"".join(partial.chunks[i] for i in range(payload.chunks))
        except KeyError as missing:
            raise ValueError(f"KV chunk {missing} is missing") from None
        finally:
            self._partial.pop(blob_id, None)
        if len(data) != payload.size or hashlib.sha256(data).hexdigest() != payload.sha256:
            raise ValueError("KV payload does not match its checksum")
        return data

    def drop(self, blob_id: str) -> None:
        self._partial.pop(blob_id, None)
