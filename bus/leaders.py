"""Asking a stream's leader to step down when it leaves its publishers unanswered.

A JetStream stream's leader on a host behind a slow, lossy link keeps its place while its
followers hear from it now and then, which is all nats-server's raft asks of a leader; it loses
it only when it misses its quorum for seconds on end. Meanwhile every confirmed publish into the
stream waits for it (docs/operations.md, "Three hosts, the network failing": the routes'
stream led from a host slowed to 512 kbit/s held a request that moved off that host's worker
until the link healed, 23 s). A publisher whose try goes unanswered for ``ATTEMPT_S`` asks the
leader to step down; the stream's current followers elect one of theirs.

Only the ingress and the planners ask (``bus.permissions.leader_step_downs``): their streams
(the requests', the routes', the control stream) are the ones a request waits on, and they run
few. A worker's terminals reach the ingress on its subscription before any stream has them. An
asker that hears every worker late is behind a slow link itself, and asks nothing: a healthy
leader asked would step down, an election of a second or two for its other publishers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from bus.channels import Consumer, matches
from bus.topology import STREAM_SUBJECTS

log = logging.getLogger(__name__)

# At most one ask per stream this often: an election takes a second or two, and a leader
# elected since the last ask deserves the time to answer.
EVERY_S = 10.0
_ASK_TIMEOUT_S = 2.0
# After an ask that got no answer or an error: a leader behind a congested link (its routes
# closing and opening again, what was on them lost) may never have had it.
RETRY_S = 2.0


class LeaderSteward:
    """Asks the leader of one of ``streams`` to step down when a publish to it went unanswered
    (:meth:`unanswered`, with the publish's subject), and the leader of one of ``durables``
    when what it should deliver does not come (:meth:`undelivered`); others are left alone."""

    def __init__(
        self, nc: NatsClient, streams: tuple[str, ...], durables: tuple[Consumer[Any], ...] = ()
    ) -> None:
        self._nc = nc
        self._subjects = [
            (stream.name, subject)
            for stream, subjects in STREAM_SUBJECTS.items()
            if stream.name in streams
            for subject in subjects
        ]
        self._durables = {c.durable for c in durables}
        # Whether the asker's own link is the slow one (``Bus.asks_unless``): then every
        # leader answers it late, and asking would only have healthy leaders step down.
        self.behind: Callable[[], bool] = lambda: False
        self._asked: dict[str, float] = {}
        self._asking: set[asyncio.Task[None]] = set()

    def unanswered(self, subject: str) -> None:
        stream = next((name for name, p in self._subjects if matches(p, subject)), None)
        if stream is not None:
            self._ask(f"STREAM.LEADER.STEPDOWN.{stream}", f"{stream}'s leader", "publishes")

    def undelivered(self, consumer: Consumer[Any]) -> None:
        if consumer.durable in self._durables:
            what = f"{consumer.stream.name}'s durable {consumer.durable}'s leader"
            api = f"CONSUMER.LEADER.STEPDOWN.{consumer.stream.name}.{consumer.durable}"
            self._ask(api, what, "deliveries")

    def _ask(self, api: str, what: str, late: str) -> None:
        now = time.monotonic()
        if now < self._asked.get(api, -EVERY_S) + EVERY_S or self.behind():
            return
        self._asked[api] = now
        task = asyncio.create_task(self._request(api, f"{what} ({late} late)"))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _request(self, api: str, why: str) -> None:
        try:
            answer = await self._nc.request(f"$JS.API.{api}", b"", timeout=_ASK_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError) as error:
            # No answer: no leader to ask (one being elected: what the ask was for), or the one
            # asked is behind a congested link, which may have dropped the ask.
            self._soon(api)
            log.warning("asked %s to step down: %r", why, error)
            return
        if b'"error"' in answer.data:
            self._soon(api)
        log.warning("asked %s to step down: %s", why, answer.data[:200])

    def _soon(self, api: str) -> None:
        """The next late publish or delivery asks ``api`` again after ``RETRY_S``."""
        self._asked[api] = time.monotonic() - EVERY_S + RETRY_S
