"""Bulk bytes in checked chunks: whole and intact, or a clear failure."""

from __future__ import annotations

import asyncio

import pytest

from bus.blobs import BlobAssembler, describe, send_blob
from bus.client import Bus

DATA = bytes(range(256)) * 40  # 10,240 bytes


async def test_chunks_in_any_order_make_the_payload() -> None:
    chunks: list[tuple[int, bytes]] = []

    async def keep(subject: str, data: bytes, headers: dict[str, str]) -> None:
        chunks.append((int(headers["Laneway-Chunk"]), data))

    payload = await send_blob(keep, "s", "b1", DATA, chunk_bytes=3000)
    assert payload.chunks == 4 == len(chunks) and payload.size == len(DATA)
    assembler = BlobAssembler()
    for index, chunk in reversed(chunks):
        assembler.add("b1", index, chunk)
    assert await assembler.take("b1", payload, timeout_s=1) == DATA


async def test_a_missing_or_corrupt_chunk_is_an_error_not_a_wait_forever() -> None:
    payload = describe(DATA, chunk_bytes=3000)
    assembler = BlobAssembler()
    assembler.add("b", 0, DATA[:3000])
    with pytest.raises(ValueError, match="1 of 4"):
        await assembler.take("b", payload, timeout_s=0.1)
    for i in range(4):
        chunk = DATA[i * 3000 : (i + 1) * 3000]
        assembler.add("c", i, chunk if i != 2 else b"x" + chunk[1:])
    with pytest.raises(ValueError, match="checksum"):
        await assembler.take("c", payload, timeout_s=1)


async def test_a_late_chunk_completes_a_waiting_take() -> None:
    payload = describe(DATA, chunk_bytes=6000)
    assembler = BlobAssembler()
    assembler.add("b", 1, DATA[6000:])
    taking = asyncio.create_task(assembler.take("b", payload, timeout_s=2))
    await asyncio.sleep(0.05)
    assembler.add("b", 0, DATA[:6000])
    assert await taking == DATA


async def test_over_the_bus(bus: Bus) -> None:
    assembler = BlobAssembler()
    await bus.subscribe_bytes("test.blobs", assembler.on_msg)
    big = bytes(range(256)) * 8192  # 2 MiB: several chunks at the default size
    payload = await send_blob(bus.publish_bytes, "test.blobs", "big", big)
    assert payload.chunks == 4
    assert await assembler.take("big", payload, timeout_s=5) == big
