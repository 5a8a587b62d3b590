"""A worker whose reports come late counts as quiet: late against its own usual delay, so that
two hosts' clock offset is no lateness, and never when every worker is late (the listener's
own link is the slow one)."""

from __future__ import annotations

from services.common.liveness import LATE_S, QUIET_S, RECENT_S, USUAL_S, Liveness
from tests.common.clocks import Clocks


def _liveness(workers: tuple[str, ...]) -> tuple[Liveness, Clocks]:
    clocks = Clocks()
    liveness = Liveness(clock=clocks.mono, wall=clocks.wall)
    liveness.registered(workers)
    return liveness, clocks


def _report(liveness: Liveness, clocks: Clocks, delays: dict[str, float]) -> None:
    """One report from each worker, written ``delay`` seconds ago by the listener's wall clock."""
    for worker, delay in delays.items():
        liveness.reported(worker, clocks.wall() - delay)


def test_a_worker_whose_reports_come_later_than_usual_is_quiet_until_they_are_on_time() -> None:
    liveness, clocks = _liveness(("a", "b"))
    # b's clock runs 5 s behind: its reports always look 5 s late, which is its usual.
    for _ in range(20):
        _report(liveness, clocks, {"a": 0.01, "b": 5.01})
        clocks.now += 0.1
    assert liveness.live() == {"a", "b"} and not liveness.late("b")
    # b's link slows: its reports now come 2 s later than they did.
    for _ in range(round(RECENT_S / 0.1) + 1):
        _report(liveness, clocks, {"a": 0.01, "b": 5.01 + LATE_S + 1})
        clocks.now += 0.1
    assert liveness.late("b") and liveness.quiet() == {"b"} and liveness.live() == {"a"}
    # Late while every report of the last RECENT_S was: one that comes on time ends it.
    _report(liveness, clocks, {"a": 0.01, "b": 5.01})
    assert liveness.live() == {"a", "b"}


def test_one_late_report_behind_a_long_step_is_not_a_slow_path() -> None:
    liveness, clocks = _liveness(("a", "b"))
    for _ in range(20):
        _report(liveness, clocks, {"a": 0.01, "b": 0.01})
        clocks.now += 0.1
    _report(liveness, clocks, {"b": LATE_S + 2})
    assert not liveness.late("b")


def test_when_every_worker_is_late_the_listener_is_the_slow_one() -> None:
    liveness, clocks = _liveness(("a", "b"))
    for _ in range(20):
        _report(liveness, clocks, {"a": 0.01, "b": 0.01})
        clocks.now += 0.1
    for _ in range(round(RECENT_S / 0.1) + 1):
        _report(liveness, clocks, {"a": LATE_S + 1, "b": LATE_S + 1})
        clocks.now += 0.1
    assert liveness.live() == {"a", "b"} and not liveness.late("a")
    # Silence still counts: b falls silent, and a, late, is the one left.
    for _ in range(round(QUIET_S / 0.1) + 1):
        _report(liveness, clocks, {"a": LATE_S + 1})
        clocks.now += 0.1
    assert liveness.quiet() == {"b"} and liveness.live() == {"a"}


def test_the_usual_delay_is_forgotten_after_its_window() -> None:
    """A path that became slower for good is the new usual after ``USUAL_S``."""
    liveness, clocks = _liveness(("a", "b"))
    _report(liveness, clocks, {"a": 0.01, "b": 0.01})
    for _ in range(round(USUAL_S / 0.5) + 2):
        clocks.now += 0.5
        _report(liveness, clocks, {"a": 0.01, "b": LATE_S + 1})
    assert not liveness.late("b")


def test_a_listener_that_hears_every_worker_late_is_behind() -> None:
    liveness, clocks = _liveness(("a", "b", "c"))
    for _ in range(20):
        _report(liveness, clocks, {"a": 0.01, "b": 0.01, "c": 0.01})
        clocks.now += 0.1
    assert not liveness.behind()
    for _ in range(round(RECENT_S / 0.1) + 1):
        _report(liveness, clocks, {"a": LATE_S + 1, "b": LATE_S + 1, "c": 0.01})
        clocks.now += 0.1
    # Two of three late: theirs are the slow links, not the listener's.
    assert not liveness.behind() and liveness.silent() == set()
    for _ in range(round(RECENT_S / 0.1) + 1):
        _report(liveness, clocks, {"a": LATE_S + 1, "b": LATE_S + 1, "c": LATE_S + 1})
        clocks.now += 0.1
    assert liveness.behind()
    # One worker alone, late, says nothing of whose link is slow.
    liveness.registered(("a",))
    assert not liveness.behind()
