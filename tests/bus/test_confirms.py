"""Confirmed publishes against a real nats-server: stored when they return, and each way a
stream does not store one is the error nats-py's JetStream publish raised (what the bus's
retrying tells apart)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, NoStreamResponseError

from bus.client import Bus
from bus.confirms import Confirmations
from bus.topology import REQUESTS, Subjects
from schemas.codec import decode_event
from schemas.events import RequestCancelled
from tests.helpers import eventually


async def once(confirms: Confirmations, subject: str, data: bytes, headers: dict[str, str]) -> None:
    """One try, sent and its answer awaited."""
    await (await confirms.send(subject, data, headers))


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


async def test_sent_now_and_stored_once_its_confirmation_is_awaited(bus: Bus) -> None:
    """`send_confirmed` has the message on the connection when it returns (what is published
    next goes out behind it); awaiting what it returns waits for the stream to store it."""
    ended = RequestCancelled(
        source="worker/w1", request_id="r1", worker_id="w1", reason="client_disconnected"
    )
    topic = Subjects.request_terminal("i1", "w1")
    seen: list[bytes] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.data)

    await bus.nc.subscribe(topic.subject, cb=on_msg)
    confirmation = await bus.send_confirmed(topic, ended)
    # Out before its confirmation was awaited.
    await eventually(lambda: bool(seen), message="not sent before its confirmation")
    await confirmation
    js = bus.nc.jetstream()
    stored = await js.get_last_msg(REQUESTS.name, topic.subject)
    assert decode_event(stored.data) == ended
    with pytest.raises(ValueError, match="not a confirmed channel"):
        await bus.send_confirmed(Subjects.placements("i1"), ended)
