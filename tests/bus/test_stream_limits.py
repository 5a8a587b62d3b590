"""Every stream is bounded in bytes and drops its oldest messages past the bound, against a real
nats-server: a burst fills the stream, not the server's disk or memory."""

from __future__ import annotations

import pytest
from nats.js.api import DiscardPolicy, StorageType

from bus.channels import Stream
from bus.client import Bus
from bus.topology import MIB, STREAM_SUBJECTS


async def test_every_stream_carries_its_byte_limit_and_discards_old(bus: Bus) -> None:
    js = bus.nc.jetstream()
    for stream in STREAM_SUBJECTS:
        config = (await js.stream_info(stream.name)).config
        assert stream.max_bytes > 0, stream.name
        assert (config.max_bytes, config.discard) == (stream.max_bytes, DiscardPolicy.OLD)


@pytest.mark.nats_only("byte limits: the in-memory broker keeps none")
async def test_a_full_stream_keeps_taking_messages_and_stays_within_its_limit(bus: Bus) -> None:
    js = bus.nc.jetstream()
    small = Stream("LW_TEST_LIMITS", StorageType.FILE, 60.0, max_bytes=MIB)
    await js.add_stream(small.config(["limits.>"]))
    try:
        payload = b"x" * (64 << 10)
        for i in range(48):  # 3 MiB into 1 MiB
            await js.publish(f"limits.{i}", payload)
        state = (await js.stream_info(small.name)).state
        assert state.bytes <= MIB
        assert state.last_seq == 48 and state.first_seq > 1
    finally:
        await js.delete_stream(small.name)
