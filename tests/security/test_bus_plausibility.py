"""The kv-indexer drops KV events that could not be true, so one forged message cannot freeze a
worker's part of the index (the `seq=10**15` attack of issue 16). That an event naming another
worker than its subject's is dropped is the bus's check (tests/bus/test_bus.py)."""

from __future__ import annotations

from schemas.events import KvBlocksStored
from services.common.kv_index.index import PrefixIndex
from services.common.kv_index.indexer import Indexer


def _stored(seq: int, block: int) -> KvBlocksStored:
    return KvBlocksStored(source="t", worker_id="w", seq=seq, block_hashes=(block,))


async def test_a_seq_past_the_stream_position_is_dropped_and_real_events_still_fold() -> None:
    indexer = Indexer(PrefixIndex())
    await indexer.on_kv(_stored(10**15, 999), position=5)
    # The replay catching up skips gaps it knows will not fill: a kept forgery would move the
    # worker's cursor past every real event.
    indexer.index.skip_gaps()
    for seq in range(1, 523):
        await indexer.on_kv(_stored(seq, seq), position=5 + seq)
    assert indexer.implausible == 1
    assert indexer.index.blocks_of("w") == 522
    assert 999 not in indexer.index.cached("w")
    assert indexer.index.duplicates == 0


async def test_a_seq_at_or_below_its_position_is_folded() -> None:
    indexer = Indexer(PrefixIndex())
    await indexer.on_kv(_stored(1, 1), position=1)
    await indexer.on_kv(_stored(2, 2), position=40)  # other workers' events in between
    assert indexer.implausible == 0
    assert indexer.index.blocks_of("w") == 2
