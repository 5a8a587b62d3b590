"""A decision's candidates are built unvalidated: each must be the model validation would give."""

from __future__ import annotations

from dataclasses import replace

from schemas.events import RouteCandidate
from services.planner.decision import decide
from services.planner.kv_policy import KvAware
from services.planner.policy import RoundRobin
from tests.planner.recorded import DISAGG, decision_inputs


def test_every_candidate_is_the_validated_model_of_its_own_fields() -> None:
    inputs = decision_inputs()
    # Integers where the model has floats (an idle worker's usage): validation makes them floats.
    inputs = replace(
        inputs, decoders=[replace(inputs.decoders[0], kv_usage=0), *inputs.decoders[1:]]
    )
    for policy in (KvAware(), RoundRobin()):
        fields = decide(policy, DISAGG, inputs).route_fields()
        candidates = list(fields["candidates"])
        if fields["prefill"] is not None:
            candidates += fields["prefill"].candidates
        assert len(candidates) >= 2
        for built in candidates:
            checked = RouteCandidate.model_validate(dict(built))
            assert built == checked
            assert built.model_dump_json() == checked.model_dump_json()
            assert isinstance(built.kv_usage, float) and isinstance(built.cost, float)
