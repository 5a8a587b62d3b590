"""Confirmed publishes against a real nats-server: stored when they return, and each way a
stream does not store one is the error nats-py's JetStream publish raised (what the bus's
retrying tells apart)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError

from bus import confirms as confirms_module
from bus.client import Bus
from bus.confirms import Confirmations, check
from bus.topology import Subjects
from schemas.codec import decode_event
from schemas.events import RequestCancelled
from tests.helpers import eventually


async def once(confirms: Confirmations, subject: str, data: bytes, headers: dict[str, str]) -> None:
    """One try, sent and its answer awaited and checked."""
    check(await (await confirms.send(subject, data, headers)))


@contextlib.asynccontextmanager
async def stream(bus: Bus, name: str) -> AsyncIterator[JetStreamContext]:
    js = bus.nc.jetstream()
    subjects = [f"{name.lower()}.>"]
    await js.add_stream(StreamConfig(name=name, subjects=subjects, storage=StorageType.MEMORY))
    try:
        yield js
    finally:
        await js.delete_stream(name)


async def test_a_confirmed_publish_is_stored_when_it_returns(bus: Bus) -> None:
    async with stream(bus, "CONFIRMS") as js:
        confirms = Confirmations(bus.nc)
        await asyncio.gather(
            *(once(confirms, f"confirms.{n}", b"x", {"Nats-Msg-Id": f"c{n}"}) for n in range(50))
        )
        assert (await js.stream_info("CONFIRMS")).state.messages == 50
        # The same id again: the stream drops the copy and still confirms it.
        await once(confirms, "confirms.0", b"x", {"Nats-Msg-Id": "c0"})
        assert (await js.stream_info("CONFIRMS")).state.messages == 50


async def test_no_stream_and_a_refusal_are_told_apart(bus: Bus) -> None:
    async with stream(bus, "REFUSES"):
        confirms = Confirmations(bus.nc)
        with pytest.raises(NoStreamResponseError):
            await once(confirms, "nostream.here", b"x", {})
        with pytest.raises(BadRequestError):
            await once(confirms, "refuses.x", b"x", {"Nats-Expected-Stream": "ANOTHER"})
        # Neither left a publish waiting.
        assert not confirms._waiting


async def test_sent_now_and_confirmed_without_a_task(bus: Bus) -> None:
    """`send_confirmed` has the message on the connection when it returns (what is published
    next goes out behind it); the stream's confirmation is checked when it comes, and a stored
    message leaves nothing to retry."""
    ended = RequestCancelled(
        source="worker/w1", request_id="r1", worker_id="w1", reason="client_disconnected"
    )
    topic = Subjects.request_terminal("i1", "w1")
    seen: list[bytes] = []
    retried: list[Coroutine[Any, Any, None]] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.data)

    await bus.nc.subscribe(topic.subject, cb=on_msg)
    await bus.send_confirmed(topic, ended, retried.append)
    await eventually(lambda: bool(seen), message="not sent")
    js = bus.nc.jetstream()
    assert topic.stream is not None
    stored = await js.get_last_msg(topic.stream.name, topic.subject)
    assert stored.data is not None and decode_event(stored.data) == ended
    await eventually(lambda: not bus._confirms._waiting, message="its answer never came")
    assert retried == []
    with pytest.raises(ValueError, match="not a confirmed channel"):
        await bus.send_confirmed(Subjects.placements("i1"), ended, retried.append)


async def test_a_refusal_is_raised_by_what_is_left_to_retry(bus: Bus) -> None:
    async with stream(bus, "SETTLES"):
        confirms = Confirmations(bus.nc)
        retried: list[Coroutine[Any, Any, None]] = []
        headers = {"Nats-Expected-Stream": "ANOTHER"}
        sent = await confirms.send("settles.x", b"x", headers)
        confirms.settle("settles.x", b"x", headers, sent, retried.append)
        await eventually(lambda: bool(retried), message="the refusal was not handed on")
        with pytest.raises(BadRequestError):
            await retried[0]


async def test_an_unanswered_try_times_out_and_is_tried_again(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber that never answers stands for a stream without a leader: each try gives up
    after ``ATTEMPT_S``, and the tries stop with the timeout after ``CONFIRM_WITHIN_S``."""
    monkeypatch.setattr(confirms_module, "ATTEMPT_S", 0.05)
    monkeypatch.setattr(confirms_module, "CONFIRM_WITHIN_S", 0.3)
    tries: list[Msg] = []

    async def silent(msg: Msg) -> None:
        tries.append(msg)

    await bus.nc.subscribe("silent.x", cb=silent)
    confirms = Confirmations(bus.nc)
    retried: list[Coroutine[Any, Any, None]] = []
    sent = await confirms.send("silent.x", b"x", {})
    confirms.settle("silent.x", b"x", {}, sent, retried.append)
    await eventually(lambda: bool(retried), message="the timeout was not handed on")
    with pytest.raises(nats.errors.TimeoutError):
        await retried[0]
    assert len(tries) >= 3
    assert not confirms._waiting


async def test_a_stream_too_busy_is_tried_again_and_any_other_refusal_is_raised(bus: Bus) -> None:
    """A stream that takes more than it can answers 429 to every publisher (one worker flooding
    its own subject refused the others' terminals), and one still storing a try answers 409
    10158: such a publish is tried again, waiting longer each time, until stored; another
    refusal is raised at once. The stream's answers
    here come from a stand-in responder on the subject."""
    busy = b'{"error": {"code": 429, "err_code": 10000, "description": "too many requests"}}'
    # A clustered stream still storing an earlier try of the same message id (seen with a host
    # cut off: the planner's route failed and its request was redelivered).
    storing = (
        b'{"error": {"code": 409, "err_code": 10158, '
        b'"description": "duplicate message id is in process"}}'
    )
    answers = iter([busy, storing, b'{"stream": "BUSY", "seq": 1, "duplicate": true}'])
    tries: list[float] = []

    async def answer(msg: Msg) -> None:
        tries.append(asyncio.get_running_loop().time())
        await msg.respond(next(answers))

    await bus.nc.subscribe("busy.x", cb=answer)
    confirms = Confirmations(bus.nc)
    await confirms.stored("busy.x", b"x", {}, await confirms.send("busy.x", b"x", {}))
    assert len(tries) == 3 and tries[2] - tries[1] > tries[1] - tries[0] > 0.05

    async def refuse(msg: Msg) -> None:
        await msg.respond(b'{"error": {"code": 400, "err_code": 10060, "description": "no"}}')

    await bus.nc.subscribe("refused.x", cb=refuse)
    with pytest.raises(BadRequestError):
        await confirms.stored("refused.x", b"x", {}, await confirms.send("refused.x", b"x", {}))


async def test_an_unanswered_try_is_told_with_its_subject(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What bus.leaders hears: each try a stream left unanswered, by subject; an answered one
    is not told."""
    monkeypatch.setattr(confirms_module, "ATTEMPT_S", 0.05)
    monkeypatch.setattr(confirms_module, "CONFIRM_WITHIN_S", 0.2)

    async def silent(msg: Msg) -> None:
        pass

    await bus.nc.subscribe("mute.x", cb=silent)
    told: list[str] = []
    confirms = Confirmations(bus.nc, told.append)
    with pytest.raises(nats.errors.TimeoutError):
        await confirms.stored("mute.x", b"x", {}, await confirms.send("mute.x", b"x", {}))
    assert len(told) >= 2 and set(told) == {"mute.x"}
    told.clear()
    topic = Subjects.request_terminal("i1", "w1")
    ended = RequestCancelled(
        source="worker/w1", request_id="r-told", worker_id="w1", reason="client_disconnected"
    )
    await bus.publish(topic, ended)
    assert told == []
