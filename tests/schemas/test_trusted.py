"""Models built unvalidated from values their builder vouches for."""

from __future__ import annotations

import pytest

from schemas.events import TokenRun
from schemas.logprobs import TokenLogprob
from schemas.trusted import trusted


def test_a_trusted_model_equals_the_validated_one_and_dumps_alike() -> None:
    logprobs = tuple(TokenLogprob(token=t, logprob=-0.5) for t in "ab")
    values = {
        "request_id": "r",
        "attempt": 1,
        "index": 3,
        "token_ids": (5, 6),
        "text": "ab",
        "logprobs": logprobs,
    }
    built, checked = trusted(TokenRun, dict(values)), TokenRun(**values)
    assert built == checked and built.model_dump_json() == checked.model_dump_json()
    assert built.model_fields_set == checked.model_fields_set
    with pytest.raises(ValueError, match="frozen"):
        built.index = 4  # type: ignore[misc]


def test_every_field_must_be_given() -> None:
    with pytest.raises(TypeError, match="request_id"):
        trusted(TokenRun, {"index": 0, "token_ids": (), "text": ""})
