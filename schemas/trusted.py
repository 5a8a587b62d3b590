"""Events built from values their builder holds checked already, without pydantic's validation:
on a worker's every token, validating a run cost more than making the rest of its message."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_set = object.__setattr__


def trusted(model: type[M], values: dict[str, Any]) -> M:
    """``model`` holding ``values``, one for each of its fields, as ``model_construct`` builds it
    less its loop over the fields (a quarter of a validation's time). The caller vouches for the
    values' types and constraints: tests pin each use to the validated model's result."""
    if len(values) != len(model.__pydantic_fields__):
        raise TypeError(f"{model.__name__} takes {sorted(model.__pydantic_fields__)}")
    built = object.__new__(model)
    _set(built, "__dict__", values)
    _set(built, "__pydantic_fields_set__", set(values))
    _set(built, "__pydantic_extra__", None)
    _set(built, "__pydantic_private__", None)
    return built
