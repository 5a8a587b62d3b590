"""A model's JSON written by orjson straight from its fields, where that is byte for byte what
pydantic writes: two to five times faster for the request path's events (a route's candidates, a
step's KV changes), which every service encodes on every request.

A model qualifies when every field is a JSON value as it stands (str, int, float, bool, None, a
UTC or naive datetime, a Literal), a tuple or a str- or int-keyed dict of those, or another
model that qualifies, and nothing about it changes how pydantic writes it (no serializer, alias,
exclusion or computed field). Any other model, or a value that orjson refuses, is written by
pydantic as before.
"""

from __future__ import annotations

import datetime
import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import orjson
from pydantic import BaseModel

_SCALARS = (str, int, float, bool, datetime.datetime, type(None))
_OPTIONS = orjson.OPT_UTC_Z | orjson.OPT_NON_STR_KEYS
# Classes found plain, for the hook that hands orjson a nested model's fields.
_PLAIN: set[type[BaseModel]] = set()


def to_json(model: BaseModel) -> bytes:
    """``model``'s JSON, the bytes pydantic's ``model_dump_json`` gives."""
    if plain(type(model)):
        try:
            return orjson.dumps(model, default=_fields, option=_OPTIONS)
        except TypeError:  # a value of a type the annotation does not promise (or a bad str)
            pass
    return model.__pydantic_serializer__.to_json(model)


def _fields(value: Any) -> dict[str, Any]:
    if type(value) in _PLAIN:
        fields: dict[str, Any] = value.__dict__
        return fields
    raise TypeError(f"{type(value).__name__} is not a plain model")


@cache
def plain(model: type[BaseModel]) -> bool:
    """Whether orjson writes ``model`` from its fields exactly as pydantic would."""
    checks = model.__pydantic_decorators__
    if checks.field_serializers or checks.model_serializers or model.model_computed_fields:
        return False
    if model.model_config.get("extra") == "allow":
        return False
    for info in model.model_fields.values():
        if info.exclude or info.alias is not None or info.serialization_alias is not None:
            return False
        if not _plain_type(info.annotation):
            return False
    _PLAIN.add(model)
    return True


def _plain_type(tp: Any) -> bool:
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        # pydantic writes a subclass's value as the declared class (its fields only).
        return not tp.__subclasses__() and plain(tp)
    if origin is Annotated:
        return _plain_type(args[0])
    if origin is tuple:
        return all(arg is Ellipsis or _plain_type(arg) for arg in args)
    if origin is dict:
        return args[0] in (str, int) and _plain_type(args[1])
    if origin in (Union, types.UnionType):
        return all(_plain_type(arg) for arg in args)
    if origin is Literal:
        return all(isinstance(arg, str | int) for arg in args)
    return tp in _SCALARS
