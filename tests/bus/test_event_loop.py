"""Services run on uvloop unless LANEWAY_EVENT_LOOP asks for the standard library's loop."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from bus.runtime import EVENT_LOOP_ENV, FATAL_PREFIX, run_service


def _loop_of_a_service() -> type[asyncio.AbstractEventLoop]:
    seen: list[type[asyncio.AbstractEventLoop]] = []

    async def main(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()))

    run_service(main)
    return seen[0]


def test_a_service_runs_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert issubclass(_loop_of_a_service(), uvloop.Loop)


def test_the_standard_loop_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    loop = _loop_of_a_service()
    assert issubclass(loop, asyncio.BaseEventLoop)
    assert not issubclass(loop, uvloop.Loop)


def test_an_unknown_loop_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(SystemExit) as exit_:
        _loop_of_a_service()
    assert exit_.value.code == 1
    assert (
        f"{FATAL_PREFIX}ValueError: {EVENT_LOOP_ENV} is uvloop or asyncio"
        in capsys.readouterr().err
    )
