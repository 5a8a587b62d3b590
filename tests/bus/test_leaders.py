"""A stream's leader asked to step down when a publish to it went unanswered: once per stream
in a while, and only for the streams the asker was given."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg

from bus import leaders
from bus.client import Bus, at_server
from bus.leaders import LeaderSteward
from bus.permissions import durable_step_downs, leader_step_downs
from bus.topology import PLANNER_INTAKE, Subjects, worker_routes
from tests.helpers import eventually


async def test_a_stalled_stream_is_asked_once_in_a_while_and_no_other(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    async def on_ask(msg: Msg) -> None:
        asked.append(msg.subject.rsplit(".", 1)[-1])

    await bus.nc.subscribe("$JS.API.STREAM.LEADER.STEPDOWN.*", cb=on_ask)
    await at_server(bus.nc)
    steward = LeaderSteward(bus.nc, leader_step_downs("planner"))
    steward.unanswered(Subjects.route("w1").subject)
    steward.unanswered(Subjects.route("w2").subject)  # the same stream, asked just now
    steward.unanswered(Subjects.kv("w1").subject)  # not a planner's to ask
    await eventually(lambda: asked == ["LW_ROUTES"], message="the routes' leader was not asked")
    monkeypatch.setattr(leaders, "EVERY_S", 0.0)
    steward.unanswered(Subjects.route("w1").subject)
    await eventually(lambda: asked == ["LW_ROUTES", "LW_ROUTES"], message="not asked again")


async def test_a_late_durable_is_asked_only_where_given(bus: Bus) -> None:
    asked: list[str] = []

    async def on_ask(msg: Msg) -> None:
        asked.append(msg.subject.removeprefix("$JS.API.CONSUMER.LEADER.STEPDOWN."))

    await bus.nc.subscribe("$JS.API.CONSUMER.LEADER.STEPDOWN.>", cb=on_ask)
    await at_server(bus.nc)
    steward = LeaderSteward(bus.nc, (), durable_step_downs("ingress"))
    steward.undelivered(worker_routes("w1"))  # not the ingress's to ask
    steward.undelivered(PLANNER_INTAKE)
    steward.undelivered(PLANNER_INTAKE)  # asked just now
    await eventually(lambda: asked == ["LW_REQUESTS.planner"], message="the intake was not asked")


async def test_an_ask_that_failed_is_asked_again_soon_and_one_that_worked_is_not(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader behind a congested link may never get the ask, or answer that the system is
    being elected: the next late publish asks again after RETRY_S, not EVERY_S."""
    monkeypatch.setattr(leaders, "RETRY_S", 0.2)
    answers = [b'{"error":{"code":503}}', b'{"success":true}']
    asked: list[bytes] = []

    async def on_ask(msg: Msg) -> None:
        asked.append(answers[len(asked)])
        await msg.respond(asked[-1])

    await bus.nc.subscribe("$JS.API.STREAM.LEADER.STEPDOWN.*", cb=on_ask)
    await at_server(bus.nc)
    steward = LeaderSteward(bus.nc, leader_step_downs("planner"))
    route = Subjects.route("w1").subject
    steward.unanswered(route)
    await eventually(lambda: len(asked) == 1, message="not asked")
    await asyncio.sleep(0.3)
    steward.unanswered(route)
    await eventually(lambda: asked == answers, message="a failed ask was not asked again")
    await asyncio.sleep(0.3)
    steward.unanswered(route)  # it worked: not again before EVERY_S
    await asyncio.sleep(0.2)
    assert asked == answers


async def test_an_asker_behind_a_slow_link_itself_asks_no_leader(bus: Bus) -> None:
    asked: list[str] = []

    async def on_ask(msg: Msg) -> None:
        asked.append(msg.subject)

    await bus.nc.subscribe("$JS.API.STREAM.LEADER.STEPDOWN.*", cb=on_ask)
    await at_server(bus.nc)
    steward = LeaderSteward(bus.nc, leader_step_downs("planner"))
    behind = True
    steward.behind = lambda: behind
    steward.unanswered(Subjects.route("w1").subject)
    await asyncio.sleep(0.2)
    assert asked == []
    behind = False
    steward.unanswered(Subjects.route("w1").subject)
    await eventually(lambda: len(asked) == 1, message="not asked once caught up")
