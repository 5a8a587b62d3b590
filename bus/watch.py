"""A live view of the records under an etcd prefix: every record now and after every change,
forever, through etcd restarts, failovers and compactions.

Any etcd user may compact (etcd's RBAC has no permission for it), and etcd compacts by itself
every 5 minutes: a watch resuming from a revision compacted away is refused, and this view then
reads the prefix afresh at once, so that nothing is missed for good."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd

from bus.skipped import Skipped
from observability.drops import RateLimitedLog

log = logging.getLogger(__name__)
# Anyone with an etcd login can write leaseless keys, or compact, as often as they like.
_limited = RateLimitedLog(log)

T = TypeVar("T")


async def watch_records(
    client: aetcd.Client,
    prefix: bytes,
    what: str,
    parse: Callable[[bytes, bytes], T],
    on_change: Callable[[dict[bytes, T]], Awaitable[None]],
    leased: bool = False,
) -> None:
    """Call ``on_change`` with every record under ``prefix`` (by key) now and after every change,
    forever; a value ``parse`` refuses (ValueError) is left out, with one warning per key.
    ``leased``: a key without a lease is left out too (a presence that would never expire).

    A broken watch (etcd restarting, a network blip, a compaction) is re-established from a fresh
    snapshot, so no change is missed for good."""
    skipped = Skipped(what)
    while True:
        try:
            await _watch_once(client, prefix, what, parse, on_change, skipped, leased)
        except asyncio.CancelledError:
            raise
        except aetcd.exceptions.RevisionCompactedError as exc:
            # The watch fell behind a compaction (its start was read before it): no wait needed.
            revision = exc.compacted_revision
            _limited.warning(
                f"compacted {what}", "%s watch met a compaction (%s); re-reading", what, revision
            )
        except Exception:
            log.warning("%s watch broke; re-reading from etcd", what, exc_info=True)
            await asyncio.sleep(1.0)


async def _watch_once(
    client: aetcd.Client,
    prefix: bytes,
    what: str,
    parse: Callable[[bytes, bytes], T],
    on_change: Callable[[dict[bytes, T]], Awaitable[None]],
    skipped: Skipped,
    leased: bool,
) -> None:
    # By key, not by the id a value names: a delete names only its key.
    records: dict[bytes, T] = {}

    def put(key: bytes, value: bytes, lease: int) -> None:
        record = skipped.parse(key, value, parse)
        if record is not None and leased and not lease:
            _limited.warning(
                f"leaseless {what}", "ignoring %s at %r: it has no lease", what, key[:200]
            )
            record = None
        if record is None:
            records.pop(key, None)
        else:
            records[key] = record

    snapshot = await client.get_prefix(prefix)
    for kv in snapshot:
        put(kv.key, kv.value, kv.lease)
    await on_change(dict(records))
    watch = await client.watch_prefix(prefix, start_revision=snapshot.header.revision + 1)
    async for event in watch:
        if event.kind == aetcd.EventKind.PUT:
            put(event.kv.key, event.kv.value, event.kv.lease)
        else:
            skipped.forget(event.kv.key)
            records.pop(event.kv.key, None)
        await on_change(dict(records))
