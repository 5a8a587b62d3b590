"""Objects in a JetStream object store (the kv-indexer's snapshots), written and read with no
more rights than that takes (bus.permissions)."""

from __future__ import annotations

import base64
import hashlib

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TEMPLATE

from bus.topology import bucket_stream


async def save_object(js: JetStreamContext, bucket: str, name: str, data: bytes) -> None:
    """Into a bucket the admin (or ``bus.provision.ensure_streams``) made."""
    store = await js.object_store(bucket)
    await store.put(name, data)


async def load_object(js: JetStreamContext, bucket: str, name: str) -> bytes | None:
    """The object's bytes, checked against its digest; None if there is none.

    Each chunk is fetched by subject, not through a consumer (as nats-py's ``get`` does): a
    reader needs no right to make consumers, whose deliveries go where their maker says."""
    try:
        store = await js.object_store(bucket)
        info = await store.get_info(name)
    except NotFoundError:
        return None
    stream = bucket_stream(bucket)
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    chunks, seq = [], 0
    for _ in range(info.chunks or 0):
        msg = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
        seq = msg.seq or seq + 1
        chunks.append(msg.data or b"")
    data = b"".join(chunks)
    digest = OBJ_DIGEST_TEMPLATE.format(
        digest=base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    )
    if len(data) != info.size or digest != info.digest:
        raise ValueError(f"object {name} in {bucket} does not match its digest")
    return data
