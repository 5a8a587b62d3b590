"""Confirmed publishes: each waits for its stream's acknowledgement, taken on one inbox
subscription of the connection's with a future per publish.

nats-py's JetStream publish is a request each, its reply waited for with ``asyncio.wait_for`` and
read into a ``PubAck`` dataclass: 32 at once, that cost the client about 45 us of CPU a confirm,
this about 27 (the server the same). Every request is confirmed three times on its way (accepted,
routed, ended), so that is some 50 us of a request's CPU.

A publish is sent first and confirmed after (:meth:`Confirmations.send`, then
:meth:`Confirmations.stored`, or :meth:`Confirmations.settle` for a publisher that does not wait),
so that a publisher can queue it on the connection with other messages, to go out in one write,
and wait for its stream's answer elsewhere.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
import orjson
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

log = logging.getLogger(__name__)

# How long one try waits for its stream's answer before it is sent again (the message id has
# the stream drop a copy). Less than nats-py's JetStream default of 5 s: a try sent to a
# stream leader that was just cut off is answered by nobody, and the next try, sent once the
# others elected a new leader, is what gets the message stored.
ATTEMPT_S = 2.0
# How long a publish is tried again while its stream answers nothing: a cluster's new leader
# for it (a server lost) is elected well within this; past it the publish fails.
CONFIRM_WITHIN_S = 30.0
# What a stream without a leader for now answers (or does not): tried again.
_RETRIED = (nats.errors.TimeoutError, NoStreamResponseError, ServiceUnavailableError)
# A stream's answer while more comes in than it can take ("too many requests": one publisher
# flooding it refuses everyone's): tried again, waiting longer each time up to this, seconds.
_BUSY = 429
_BUSY_WAIT_MAX_S = 2.0
# A clustered stream's answer to a try whose message id an earlier try of it is still being
# stored under (a quorum slow to answer, as while a server is cut off): not a refusal; asked
# again, the stream answers with that message's place once it has it.
_IN_PROCESS = 10158
# The server's answer for a subject no stream takes (it tells requesters there is nobody).
_NO_RESPONDERS = "503"
# In a stream's answer only when it refused the message (a PubAck names stream, seq,
# duplicate and domain): most answers are told stored without parsing them.
_ERROR = b'"error"'


class Confirmations:
    def __init__(self, nc: NatsClient, unanswered: Callable[[str], None] | None = None) -> None:
        """``unanswered``: told the subject of each try its stream left unanswered for
        ``ATTEMPT_S`` (bus.leaders asks a stalled leader to step down)."""
        self._nc = nc
        self._unanswered = unanswered
        self._prefix = ""
        self._sub: Subscription | None = None
        self._starting = asyncio.Lock()
        self._tokens = itertools.count()
        # A try's answer and the timer that gives up on it, by the token of its reply subject.
        self._waiting: dict[str, tuple[asyncio.Future[bytes], asyncio.TimerHandle]] = {}

    async def send(
        self, subject: str, data: bytes, headers: dict[str, str]
    ) -> asyncio.Future[bytes]:
        """Queue one try on the connection now, behind what was published before; returns the
        future of its stream's answer (the reply's bytes: :func:`check` it), which fails with
        ``nats.errors.TimeoutError`` when none comes in ``ATTEMPT_S``, or
        ``NoStreamResponseError`` when no stream takes ``subject``."""
        if self._sub is None:
            await self._start()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bytes] = loop.create_future()
        # A timer, not asyncio.timeout around an await: no task needs to wait for the answer.
        self._waiting[token] = (answer, loop.call_later(ATTEMPT_S, self._expire, token))
        try:
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
        except BaseException:
            self._forget(token)
            raise
        return answer

    async def stored(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        sent: asyncio.Future[bytes],
    ) -> None:
        """Return once a stream has stored the message whose first try :meth:`send` sent
        (``sent``, its answer), or raise as nats-py's JetStream publish does: an ``APIError``
        (the stream refused it), ``NoStreamResponseError``, ``nats.errors.TimeoutError``. A
        stream whose leader was on a server that went answers nothing until its others elect
        one (seconds): the publish is repeated until then (``CONFIRM_WITHIN_S``), and the
        message id has the stream drop a copy it had stored unconfirmed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempts = 0
        wait = 0.1
        answer: asyncio.Future[bytes] | None = sent
        while True:
            try:
                check(await (answer or await self.send(subject, data, headers)))
                break
            except (*_RETRIED, APIError) as error:
                if isinstance(error, nats.errors.TimeoutError) and self._unanswered is not None:
                    self._unanswered(subject)
                busy = isinstance(error, APIError) and (
                    error.code == _BUSY or error.err_code == _IN_PROCESS
                )
                if (isinstance(error, APIError) and not busy) or (
                    loop.time() > started + CONFIRM_WITHIN_S
                ):
                    raise
                answer = None
                attempts += 1
                await asyncio.sleep(wait)
                if busy:
                    wait = min(2 * wait, _BUSY_WAIT_MAX_S)
        if attempts:
            waited = loop.time() - started
            log.warning(
                "the stream of %s confirmed after %.1f s (%d tries)", subject, waited, attempts + 1
            )

    def settle(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        sent: asyncio.Future[bytes],
        retry: Callable[[Coroutine[Any, Any, None]], object],
    ) -> None:
        """Have the answer to ``sent`` (:meth:`send`'s first try) checked when it comes, by a
        callback: a message its stream stored costs no task. Otherwise :meth:`stored`'s tries
        go on, or its error is raised, in the coroutine handed to ``retry`` to run."""

        def answered(answer: asyncio.Future[bytes]) -> None:
            if not answer.cancelled() and answer.exception() is None:
                reply = answer.result()
                if _ERROR not in reply:
                    return
            retry(self.stored(subject, data, headers, answer))

        sent.add_done_callback(answered)

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                self._prefix = self._nc.new_inbox() + "."
                self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_reply)

    def _forget(self, token: str) -> asyncio.Future[bytes] | None:
        waiting = self._waiting.pop(token, None)
        if waiting is None:
            return None
        answer, timer = waiting
        timer.cancel()
        return answer

    def _expire(self, token: str) -> None:
        answer = self._forget(token)
        if answer is not None and not answer.done():
            answer.set_exception(nats.errors.TimeoutError())

    async def _on_reply(self, msg: Msg) -> None:
        answer = self._forget(msg.subject[len(self._prefix) :])
        if answer is None or answer.done():  # given up on already
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            answer.set_exception(NoStreamResponseError())
        else:
            answer.set_result(msg.data)


def check(reply: bytes) -> None:
    """Raise the stream's refusal if its answer ``reply`` is one (an ``APIError``)."""
    if _ERROR in reply:
        ack = orjson.loads(reply)
        if "error" in ack:
            APIError.from_error(ack["error"])
