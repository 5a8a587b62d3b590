"""An engine's KV changes as the events the rest of Laneway folds (live and offline alike)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.events import CacheWiped, KvChanged, KvOp, RemovedRun, StoredRun
from schemas.trusted import trusted
from services.engine.protocol import BlocksRemoved, BlocksStored, CacheCleared, KvChange


def coalesced(changes: Sequence[KvChange]) -> list[KvChange]:
    """One step's changes with neighbours that say one thing as one: removals from one tier in a
    row (a step evicts for each request it admits, one after the other), and a stored run that
    continues the run just before it (its parent is that run's last block). Folded in order they
    leave the same index in fewer events, each a stored message every reader of the KV stream
    takes in; nothing is moved past a change of another kind."""
    out: list[KvChange] = []
    for change in changes:
        joined = _joined(out[-1], change) if out else None
        if joined is None:
            out.append(change)
        else:
            out[-1] = joined
    return out


def _joined(last: KvChange, change: KvChange) -> KvChange | None:
    """``last`` then ``change`` as one change, if they can be."""
    if (
        isinstance(last, BlocksRemoved)
        and isinstance(change, BlocksRemoved)
        and last.tier == change.tier
    ):
        return BlocksRemoved(last.block_hashes + change.block_hashes, last.tier)
    if (
        isinstance(last, BlocksStored)
        and isinstance(change, BlocksStored)
        and change.tier == last.tier
        and change.parent_hash == last.block_hashes[-1]
    ):
        return BlocksStored(last.block_hashes + change.block_hashes, last.parent_hash, last.tier)
    return None


def continued(
    held: Sequence[KvChange], changes: Sequence[KvChange]
) -> tuple[list[KvChange], list[KvChange]]:
    """``held`` (a step's changes, coalesced) with each stored run of ``changes`` (the next
    step's) that continues one of its runs joined to that run, and what is left of ``changes``.
    A prompt's blocks are stored by the step that computes them and the block its first answer
    token completes by the next: the same chain, one event. Folded in order, ``held`` then the
    rest leave the index that ``held`` then ``changes`` do: a run joins only where no removal
    of one of its blocks and no clear comes between."""
    out = list(held)
    removed = {h for c in out if isinstance(c, BlocksRemoved) for h in c.block_hashes}
    cleared = any(isinstance(c, CacheCleared) for c in out)
    # The stored runs of ``held`` by tier and last block: where a run of the next step may join.
    runs: dict[tuple[str, int | None], int] = {
        (c.tier, c.block_hashes[-1]): i for i, c in enumerate(out) if isinstance(c, BlocksStored)
    }
    rest: list[KvChange] = []
    for change in changes:
        if isinstance(change, BlocksStored):
            at = runs.pop((change.tier, change.parent_hash), None)
            run = out[at] if at is not None else None
            if (
                at is not None
                and isinstance(run, BlocksStored)
                and not cleared
                and removed.isdisjoint(change.block_hashes)
            ):
                out[at] = BlocksStored(
                    run.block_hashes + change.block_hashes, run.parent_hash, run.tier
                )
                runs[(run.tier, change.block_hashes[-1])] = at
                continue
        elif isinstance(change, BlocksRemoved):
            removed.update(change.block_hashes)
        else:
            cleared = True
        rest.append(change)
    return out, rest


def kv_changed(changes: Sequence[KvChange], worker_id: str, seq: int) -> KvChanged:
    """One event of a step's ``changes`` (at least one), in their order."""
    # The engine's own hashes and tiers: nothing a validation of each change would refuse.
    ops = tuple(_op(change) for change in changes)
    return KvChanged(source=f"worker/{worker_id}", worker_id=worker_id, seq=seq, changes=ops)


def _op(change: KvChange) -> KvOp:
    if isinstance(change, BlocksStored):
        return trusted(StoredRun, {
            "op": "stored", "parent_hash": change.parent_hash,
            "block_hashes": change.block_hashes, "tier": change.tier,
        })  # fmt: skip
    if isinstance(change, BlocksRemoved):
        return trusted(
            RemovedRun, {"op": "removed", "block_hashes": change.block_hashes, "tier": change.tier}
        )
    return trusted(CacheWiped, {"op": "cleared"})
