"""read_log against a real nats-server: 32 MiB of messages of 4 MiB each (the size of a long
prompt's events) read back whole and in order, and a window that holds none of them ends too."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from bus.client import Bus
from bus.topology import Subjects
from infra.embedded import NATS_MAX_PAYLOAD, EmbeddedServer
from infra.recording import Recorded, read_log
from schemas.codec import encode
from schemas.events import KvBlocksStored, new_id
from tests.helpers import eventually


def _big(worker: str, seq: int) -> KvBlocksStored:
    """A KV event of about 4 MiB (decimal 64-bit hashes are about 20 bytes each)."""
    rng = random.Random(seq)
    hashes = tuple(rng.getrandbits(64) for _ in range(200_000))
    return KvBlocksStored(source=f"worker/{worker}", worker_id=worker, seq=seq, block_hashes=hashes)


async def test_large_messages_read_back_whole_and_in_order(
    nats_bus: Bus, nats_server: EmbeddedServer
) -> None:
    worker = new_id()
    topic = Subjects.kv(worker)
    # Eight: more than one fetch's worth, and under the 64 MiB a server lets a connection have on
    # its way, which a loaded machine reached with twenty.
    events = [_big(worker, seq) for seq in range(1, 9)]
    assert 3 << 20 < len(encode(events[0])) < NATS_MAX_PAYLOAD
    before = datetime.now(UTC)
    for event in events:
        await nats_bus.publish(topic, event)

    async def all_stored() -> list[Recorded] | None:
        read = [r for r in await read_log(nats_server.url) if r.subject == topic.subject]
        return read if len(read) == len(events) else None

    read = await eventually(all_stored, timeout=30, interval=0.5)
    assert [r.event for r in read] == events
    assert all(r.stream == "LW_KV" and r.time >= before - timedelta(seconds=1) for r in read)
    seqs = [r.seq for r in read]
    assert seqs == sorted(seqs)
    # A window that starts after the last: none of them, and the read still ends.
    later = await read_log(nats_server.url, since=datetime.now(UTC) + timedelta(seconds=5))
    assert not [r for r in later if r.subject == topic.subject]
