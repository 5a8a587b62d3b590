"""Confirmed publishes: each waits for its stream's acknowledgement, taken on one inbox
subscription of the connection's with a future per publish.

nats-py's JetStream publish is a request each, its reply waited for with ``asyncio.wait_for`` and
read into a ``PubAck`` dataclass: 32 at once, that cost the client about 45 us of CPU a confirm,
this about 27 (the server the same). Every request is confirmed three times on its way (accepted,
routed, ended), so that is some 50 us of a request's CPU.

A publish is sent first and confirmed after (:meth:`Confirmations.send`, then
:meth:`Confirmations.stored`), so that a publisher
can queue it on the connection with other messages, to go out in one write, and wait for its
stream's answer elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine
from typing import Any

import nats.errors
import orjson
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

log = logging.getLogger(__name__)

# How long one try waits for its stream's answer (nats-py's JetStream default).
ATTEMPT_S = 5.0
# How long a publish is tried again while its stream answers nothing: a cluster's new leader
# for it (a server lost) is elected well within this; past it the publish fails.
CONFIRM_WITHIN_S = 30.0
# What a stream without a leader for now answers (or does not): tried again.
_RETRIED = (nats.errors.TimeoutError, NoStreamResponseError, ServiceUnavailableError)
# The server's answer for a subject no stream takes (it tells requesters there is nobody).
_NO_RESPONDERS = "503"


class Confirmations:
    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._starting = asyncio.Lock()
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[bytes]] = {}

    async def send(
        self, subject: str, data: bytes, headers: dict[str, str]
    ) -> Coroutine[Any, Any, None]:
        """Queue one try on the connection now, behind what was published before; returns what
        waits for its stream's answer, which must be awaited: it returns once the stream stored
        the message, or raises as nats-py's JetStream publish does: ``nats.errors.TimeoutError``
        (no answer in time), ``NoStreamResponseError`` (no stream takes ``subject``), an
        ``APIError`` (the stream refused it)."""
        if self._sub is None:
            await self._start()
        token = str(next(self._tokens))
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[token] = answer
        try:
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
        except BaseException:
            self._waiting.pop(token, None)
            raise
        return self._answered(token, answer)

    async def _answered(self, token: str, answer: asyncio.Future[bytes]) -> None:
        try:
            async with asyncio.timeout(ATTEMPT_S):
                reply = await answer
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            self._waiting.pop(token, None)
        ack = orjson.loads(reply)
        if "error" in ack:
            APIError.from_error(ack["error"])

    async def stored(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        sent: Coroutine[Any, Any, None],
    ) -> None:
        """Return once a stream has stored the message whose first try :meth:`send` sent
        (``sent``, its answer). A stream whose leader was on a server that went answers nothing
        until its others elect one (seconds): the publish is repeated until then
        (``CONFIRM_WITHIN_S``), and the message id has the stream drop a copy it had stored
        unconfirmed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempts = 0
        attempt: Coroutine[Any, Any, None] | None = sent
        while True:
            try:
                await (attempt or await self.send(subject, data, headers))
                break
            except _RETRIED:
                if loop.time() > started + CONFIRM_WITHIN_S:
                    raise
                attempt = None
                attempts += 1
                await asyncio.sleep(0.1)
        if attempts:
            waited = loop.time() - started
            log.warning(
                "the stream of %s confirmed after %.1f s (%d tries)", subject, waited, attempts + 1
            )

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                self._prefix = self._nc.new_inbox() + "."
                self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        answer = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if answer is None or answer.done():  # given up on already
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            answer.set_exception(NoStreamResponseError())
        else:
            answer.set_result(msg.data)
