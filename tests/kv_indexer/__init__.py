"""Random KV event histories, and their delivery as at-least-once transport scrambles them."""

from __future__ import annotations

import random
from collections.abc import Sequence

from schemas.events import (
    CacheWiped,
    KvBlocksRemoved,
    KvBlocksStored,
    KvChanged,
    KvCleared,
    KvEvent,
    RemovedRun,
    StoredRun,
)
from services.common.kv_index.index import PrefixIndex


def history(rng: random.Random, workers: int = 4, events: int = 400) -> list[KvEvent]:
    """Events of ``workers`` workers in publication order: stores of prompt prefixes drawn from
    a tree of shared prefixes, evictions, and now and then a cleared cache; a third of them a
    step's several changes as one event, the rest one change each (as workers before batching)."""
    chains = [[rng.getrandbits(64) for _ in range(12)]]
    for _ in range(15):
        parent = rng.choice(chains)
        tail = [rng.getrandbits(64) for _ in range(rng.randrange(1, 10))]
        chains.append(parent[: rng.randrange(len(parent) + 1)] + tail)
    names = [f"w{i}" for i in range(workers)]
    cached: dict[str, list[int]] = {name: [] for name in names}
    seq = dict.fromkeys(names, 0)
    out: list[KvEvent] = []
    for _ in range(events):
        name = rng.choice(names)
        seq[name] += 1
        ops = [_change(rng, chains, cached, name) for _ in range(rng.choice((1, 1, 2, 4)))]
        if len(ops) > 1:
            out.append(KvChanged(source="t", worker_id=name, seq=seq[name], changes=tuple(ops)))
        elif isinstance(ops[0], StoredRun):
            blocks = ops[0].block_hashes
            out.append(
                KvBlocksStored(source="t", worker_id=name, seq=seq[name], block_hashes=blocks)
            )
        elif isinstance(ops[0], RemovedRun):
            gone = ops[0].block_hashes
            out.append(
                KvBlocksRemoved(source="t", worker_id=name, seq=seq[name], block_hashes=gone)
            )
        else:
            out.append(KvCleared(source="t", worker_id=name, seq=seq[name]))
    return out


def _change(
    rng: random.Random, chains: list[list[int]], cached: dict[str, list[int]], name: str
) -> StoredRun | RemovedRun | CacheWiped:
    """One change of worker ``name``'s cache, applied to ``cached``."""
    roll = rng.random()
    held = cached[name]
    if roll < 0.03:
        held.clear()
        return CacheWiped()
    if roll < 0.35 and held:
        gone = rng.sample(held, rng.randrange(1, min(len(held), 6) + 1))
        cached[name] = [block for block in held if block not in gone]
        return RemovedRun(block_hashes=tuple(gone))
    chain = rng.choice(chains)
    blocks = tuple(chain[: rng.randrange(1, len(chain) + 1)])
    held.extend(block for block in blocks if block not in held)
    return StoredRun(block_hashes=blocks)


def scramble(
    events: Sequence[KvEvent], rng: random.Random, window: float, duplicates: float = 0.2
) -> list[KvEvent]:
    """The events as redelivery leaves them: each moved up to ``window`` places, a share of them
    delivered again later on, and workers interleaved anew."""
    keyed = []
    for place, event in enumerate(events):
        keyed.append((place + rng.uniform(0, window), event))
        if rng.random() < duplicates:
            keyed.append((place + rng.uniform(0, 3 * window), event))
    keyed.sort(key=lambda pair: pair[0])
    return [event for _, event in keyed]


def fold(events: Sequence[KvEvent]) -> dict[str, frozenset[int]]:
    """What each worker caches after ``events``, folded in order by the plainest model."""
    cached: dict[str, set[int]] = {}
    for event in events:
        held = cached.setdefault(event.worker_id, set())
        for change in event.changes if isinstance(event, KvChanged) else (event,):
            if isinstance(change, KvBlocksStored | StoredRun):
                held.update(change.block_hashes)
            elif isinstance(change, KvBlocksRemoved | RemovedRun):
                held.difference_update(change.block_hashes)
            else:
                held.clear()
    return {name: frozenset(held) for name, held in cached.items() if held}


def state(index: PrefixIndex) -> dict[str, frozenset[int]]:
    return {name: index.cached(name) for name in index.workers()}


def replay(events: Sequence[KvEvent], index: PrefixIndex | None = None) -> PrefixIndex:
    index = PrefixIndex() if index is None else index
    for event in events:
        index.apply(event)
    return index
