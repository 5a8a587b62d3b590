"""The ingress's context limit follows the workers' registrations."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from schemas.messages import WorkerRegistration
from services.common.tokenizer import ByteTokenizer
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.errors import InvalidRequest
from services.ingress.intake import Intake
from services.ingress.openai_models import parse_completion_request
from services.ingress.settings import IngressApiSettings
from tests.helpers import registration

MODEL = "laneway-sim"


def serving(worker_id: str, max_model_len: int | None, model: str = MODEL) -> WorkerRegistration:
    return registration(worker_id, max_model_len).model_copy(update={"model": model})


async def limit_of(*workers: WorkerRegistration) -> WorkerContextLimit:
    limit = WorkerContextLimit()
    await limit.on_workers({w.worker_id: w for w in workers})
    return limit


def intake(limit: WorkerContextLimit, **settings: Any) -> Intake:
    return Intake(ByteTokenizer(), IngressApiSettings(instance_id="i", **settings), limit)


def body(prompt_len: int, max_tokens: int | None = None) -> bytes:
    fields: dict[str, Any] = {"model": MODEL, "prompt": "x" * prompt_len}
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    return orjson.dumps(fields)


async def test_the_smallest_registered_limit_holds() -> None:
    limit = await limit_of(serving("a", 50_000), serving("b", 40_000))
    assert limit.tokens(MODEL) == 40_000
    spec = intake(limit).spec(parse_completion_request(body(39_000)))
    # The default completion shrinks to the room the context leaves.
    assert spec.sampling.max_tokens == 256
    assert intake(limit).spec(parse_completion_request(body(39_900))).sampling.max_tokens == 100
    with pytest.raises(InvalidRequest) as refused:
        intake(limit).spec(parse_completion_request(body(39_999, max_tokens=2)))
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 40000 tokens" in refused.value.message


async def test_a_setting_only_lowers_the_workers_limit() -> None:
    limit = await limit_of(serving("a", 50_000))
    low = intake(limit, max_model_len=100)
    with pytest.raises(InvalidRequest):
        low.spec(parse_completion_request(body(100, max_tokens=1)))
    high = intake(limit, max_model_len=1_000_000)
    with pytest.raises(InvalidRequest):
        high.spec(parse_completion_request(body(50_000, max_tokens=1)))


async def test_no_known_limit_takes_the_request() -> None:
    # Before any worker registered one, or only old records without one.
    limit = await limit_of(serving("old", None))
    assert limit.tokens(MODEL) is None
    spec = intake(limit).spec(parse_completion_request(body(100_000)))
    assert spec.sampling.max_tokens == 256


async def test_the_last_known_limit_stands_while_no_worker_is_registered() -> None:
    limit = await limit_of(serving("a", 1_000))
    await limit.on_workers({})
    assert limit.tokens(MODEL) == 1_000
    await limit.on_workers({"b": serving("b", 2_000)})
    assert limit.tokens(MODEL) == 2_000


async def test_each_model_is_held_to_its_own_workers_limit() -> None:
    limit = await limit_of(serving("a", 1_000), serving("b", 50_000, model="big"))
    assert (limit.tokens(MODEL), limit.tokens("big"), limit.tokens("none")) == (1_000, 50_000, None)
    taking = intake(limit, served_model_names=(MODEL, "big"))
    long = {"model": "big", "prompt": "x" * 10_000, "max_tokens": 1}
    assert taking.spec(parse_completion_request(orjson.dumps(long))).sampling.max_tokens == 1
    with pytest.raises(InvalidRequest):
        taking.spec(parse_completion_request(orjson.dumps({**long, "model": MODEL})))


async def test_the_spec_built_unvalidated_is_the_one_validation_builds() -> None:
    asked = orjson.dumps({
        "model": "laneway-sim", "prompt": "hé " * 20, "max_tokens": 7, "temperature": 0,
        "top_p": 0.5, "seed": -(2**63), "stop": ["\n", "x"], "stop_token_ids": [3, 0],
        "ignore_eos": True,
    })  # fmt: skip
    for tenant in (None, "acme"):
        spec = intake(await limit_of()).spec(parse_completion_request(asked), tenant)
        checked = type(spec).model_validate(spec.model_dump())
        assert spec == checked and spec.sampling == checked.sampling
        assert spec.model_dump_json() == checked.model_dump_json()
        assert spec.model_fields_set == checked.model_fields_set
