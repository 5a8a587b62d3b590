"""The progress reporter: plain lines into a file or a pipe, a redrawn bar on a terminal."""

from __future__ import annotations

import io

import pytest

from infra.progress import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_a_line_each_tenth_and_every_few_seconds() -> None:
    out, clock = io.StringIO(), _Clock()
    with Progress("replay", 1000, out, every_s=5.0, clock=clock) as progress:
        for done in range(0, 1000, 10):  # a tenth each 5 s of the fake clock: lines at tenths
            clock.now = done * 0.05
            progress.update(done)
        clock.now = 60.0
        progress.update(990)  # no new tenth, but 10 s since the last line
    lines = out.getvalue().splitlines()
    assert lines[0] == "replay: 0/1000 (0%), 0:00 elapsed, ETA ?"
    assert lines[1] == "replay: 100/1000 (10%), 0:05 elapsed, ETA 0:45"
    assert [line.split()[1] for line in lines] == [
        *(f"{n}/1000" for n in range(0, 1000, 100)),
        "990/1000",
        "1000/1000",
    ]
    assert "\r" not in out.getvalue()


def test_not_a_terminal_is_quiet_between_tenths() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("replay", 1000, out, clock=clock)
    for done in range(99):
        progress.update(done)
    assert len(out.getvalue().splitlines()) == 1


def test_a_terminal_gets_one_redrawn_bar_with_an_eta() -> None:
    out, clock = _Terminal(), _Clock()
    with Progress("policy kv", 200, out, clock=clock) as progress:
        progress.update(0)
        clock.now = 30.0
        progress.update(50)
        progress.update(60)  # within the redraw interval: not drawn
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[1].startswith("policy kv [#######.......................] 50/200 (25%)")
    assert frames[1].rstrip().endswith("0:30 elapsed, ETA 1:30")
    assert frames[-1].startswith("policy kv [" + "#" * 30 + "] 200/200 (100%)")
    assert len(frames) == 3


def test_a_failed_run_does_not_claim_to_be_done() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress("replay", 10, out, clock=_Clock()) as progress:
        progress.update(3)
        raise RuntimeError("boom")
    assert out.getvalue().splitlines()[-1].startswith("replay: 3/10 (30%)")


def test_the_clock_starts_at_a_first_update_of_nothing_done() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("live", 10, out, clock=clock)
    clock.now = 20.0  # a cluster starting: not the work's time
    progress.update(0)
    clock.now = 25.0
    progress.update(5)
    assert out.getvalue().splitlines()[-1] == "live: 5/10 (50%), 0:05 elapsed, ETA 0:05"
