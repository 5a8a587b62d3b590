"""A recorded decision, decided again from its event alone: the same code gives it back; a
changed input or setting shows as the terms that moved."""

from __future__ import annotations

from services.planner.decision import REBOUND, decide, inputs_of, rebind
from services.planner.kv_policy import KvAware, KvSettings
from services.planner.replay import differences, redecide
from tests.planner.recorded import DISAGG, MEASURED, decision_inputs, recorded


def test_an_event_carries_every_input_of_its_decision() -> None:
    event = recorded(KvAware())
    assert inputs_of(event) == decision_inputs()
    assert event.policy_turn == 7


def test_the_same_code_decides_a_recorded_request_alike() -> None:
    event = recorded(KvAware())
    assert differences(event, redecide(event, KvAware(), DISAGG)) == []


def test_a_workers_measured_step_costs_are_an_input_of_the_decision() -> None:
    event = recorded(KvAware())
    b = next(c for c in event.candidates if c.worker_id == "b")
    assert b.step_cost == MEASURED
    unmeasured = event.model_copy(
        update={
            "candidates": tuple(c.model_copy(update={"step_cost": None}) for c in event.candidates)
        }
    )
    # Predicted with the perf model instead, b's costs are not what the record says.
    moved = differences(unmeasured, redecide(unmeasured, KvAware(), DISAGG))
    assert any(line.startswith("b.cost: ") for line in moved), moved
    assert not any(line.startswith("a.cost: ") for line in moved), moved


def test_other_settings_show_as_the_terms_that_moved() -> None:
    event = recorded(KvAware())
    moved = differences(event, redecide(event, KvAware(KvSettings(stall_weight=2.0)), DISAGG))
    assert moved
    assert any(line.startswith("a.cost: ") for line in moved)
    # Terms the setting does not touch stay out of the list.
    assert not any(".predicted_queue_ms" in line or ".waiting:" in line for line in moved)


def test_a_decision_another_replicas_session_binding_moved_is_moved_alike() -> None:
    event = recorded(KvAware())
    policy = KvAware()
    policy.turn = event.policy_turn
    other = "b" if event.worker_id == "a" else "a"
    rebound = rebind(decide(policy, DISAGG, inputs_of(event)), inputs_of(event), other)
    moved = event.model_copy(update=rebound.route_fields())
    assert moved.reason == REBOUND and moved.worker_id == other
    assert differences(moved, redecide(moved, KvAware(), DISAGG)) == []
    # Without the record saying so, the replay decides as the policy does.
    unsaid = moved.model_copy(update={"reason": event.reason})
    assert differences(unsaid, redecide(unsaid, KvAware(), DISAGG))
