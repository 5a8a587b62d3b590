"""A planner replica whose requests all come late leaves the intake to the other replicas (when
its turn allows: tests/planner/test_intake_turn.py), and takes it again after a while; judged per
ingress, against each one's usual delay (its clock's offset)."""

from __future__ import annotations

from services.common.liveness import LATE_S, RECENT_S
from services.planner.intake_gate import HOLD_S, IntakeGate
from tests.common.clocks import Clocks


def _heard(gate: IntakeGate, clocks: Clocks, delays: dict[str, float], seconds: float) -> None:
    """A request from each ingress every 0.1 s for ``seconds``, each ``delay`` old."""
    for _ in range(round(seconds / 0.1)):
        for ingress, delay in delays.items():
            gate.heard(ingress, clocks.wall() - delay)
        clocks.now += 0.1


def test_a_replica_hearing_requests_late_leaves_them_to_others_and_comes_back() -> None:
    clocks = Clocks()
    gate = IntakeGate(clocks.mono, clocks.wall)
    # i2's clock runs 3 s behind: its requests look 3 s late, which is its usual.
    _heard(gate, clocks, {"i1": 0.01, "i2": 3.01}, 5)
    assert not gate.late()
    # Only i1's come late: not yet this replica's link.
    _heard(gate, clocks, {"i1": 0.01 + LATE_S + 1, "i2": 3.01}, RECENT_S + 0.2)
    assert not gate.late()
    _heard(gate, clocks, {"i1": 0.01 + LATE_S + 1, "i2": 3.01 + LATE_S + 1}, RECENT_S + 0.2)
    assert gate.late()
    gate.leave()
    assert not gate.taking and not gate.back()
    clocks.now += HOLD_S
    assert gate.back() and gate.taking
    # Nothing heard since: nothing to call late until a request comes.
    assert not gate.late()
    _heard(gate, clocks, {"i1": 0.01}, 0.1)
    assert not gate.late()


def test_after_coming_back_the_first_late_request_is_enough_to_leave_again() -> None:
    clocks = Clocks()
    gate = IntakeGate(clocks.mono, clocks.wall)
    _heard(gate, clocks, {"i1": 0.01}, 5)
    _heard(gate, clocks, {"i1": LATE_S + 2}, RECENT_S + 0.2)
    assert gate.late()
    gate.leave()
    clocks.now += HOLD_S
    assert gate.back()
    gate.heard("i1", clocks.wall() - (LATE_S + 2))
    assert gate.late()
