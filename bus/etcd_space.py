"""etcd's space alarm, cleared: past its quota etcd raises NOSPACE and refuses every write
(registrations, session bindings, roles) until someone frees space and disarms the alarm.

Auto-compaction (infra/embedded.py) keeps the history short, so an alarm means a burst of
writes outran it: compacting to now and defragmenting gives the space back, then disarming
lets writes in again. Should the data itself fill the quota, the alarm comes straight back,
and says so in the log each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aetcd

from bus.registry import WORKERS_PREFIX

log = logging.getLogger(__name__)

# etcdserverpb.AlarmType.NOSPACE
_NOSPACE = 1


async def clear_space_alarm(client: aetcd.Client) -> bool:
    """Free space and disarm NOSPACE if etcd raised it; True if it had."""
    raised = [alarm async for alarm in client.list_alarms() if alarm.alarm_type == _NOSPACE]
    if not raised:
        return False
    log.warning("etcd is out of space (NOSPACE): compacting, defragmenting, disarming")
    # A read's header carries the cluster's revision; reads still work under the alarm. The
    # workers' keys are a range the planner (which runs this) may read with etcd auth on.
    revision = (await client.get_prefix(WORKERS_PREFIX, keys_only=True)).header.revision
    with contextlib.suppress(aetcd.exceptions.RevisionCompactedError):
        await client.compact(revision, physical=True)
    try:
        await client.defragment()
    except aetcd.exceptions.ClientError as exc:
        # Only etcd's root may defragment; compacted, the space is reused at least.
        if "permission denied" not in str(exc):
            raise
        log.warning("etcd's root must defragment it (etcdctl defrag): %s", exc)
    for alarm in raised:
        await client.disarm_alarm(alarm.member_id)
    return True


async def guard_space(client: aetcd.Client, every_s: float = 30.0) -> None:
    """Clear the space alarm whenever etcd raises it, forever."""
    while True:
        try:
            await clear_space_alarm(client)
        except asyncio.CancelledError:
            raise
        except Exception:  # etcd away: the next round asks again
            log.warning("checking etcd's space alarm failed", exc_info=True)
        await asyncio.sleep(every_s)
