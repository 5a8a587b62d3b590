"""An event model's JSON checked and read by msgspec, for the one hot decode where pydantic's
per-object cost shows (a step's ``TokenBatch``: hundreds of runs a message, tens of thousands a
second at an ingress). The struct is derived from the pydantic model's own fields and
constraints, not written again, and is at least as strict: every field required, unknown fields
refused, no coercion of types (a number for a string, ``3.0`` for an int). A payload it refuses
may still be a valid event; the caller then decodes it the usual way
(:func:`schemas.codec.decode_event`), so it changes what is fast, never what is accepted.
"""

from __future__ import annotations

import datetime
import types
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import msgspec
from pydantic import BaseModel

# annotated_types' constraints pydantic puts in a field's metadata, as msgspec.Meta's.
_CONSTRAINTS: dict[type, str] = {
    annotated_types.MaxLen: "max_length",
    annotated_types.MinLen: "min_length",
    annotated_types.Ge: "ge",
    annotated_types.Gt: "gt",
    annotated_types.Le: "le",
    annotated_types.Lt: "lt",
}
_PLAIN = (str, int, float, bool, datetime.datetime, type(None))


@cache
def struct_of(model: type[BaseModel]) -> type[msgspec.Struct]:
    """``model`` as a frozen msgspec struct with the same field names, types and constraints;
    a TypeError at once for a field it cannot carry over exactly (a validator, a constraint it
    does not know), so a schema change cannot make this quietly less strict."""
    config = model.model_config
    checks = model.__pydantic_decorators__
    if config.get("extra") != "forbid" or checks.field_validators or checks.model_validators:
        raise TypeError(f"{model.__name__}: only models that forbid extra fields, unvalidated")
    fields = [
        (name, _annotated(info.annotation, info.metadata, f"{model.__name__}.{name}"))
        for name, info in model.model_fields.items()
    ]
    return msgspec.defstruct(
        model.__name__, fields, forbid_unknown_fields=True, frozen=True, module=__name__
    )


def _annotated(tp: Any, metadata: list[Any], where: str) -> Any:
    inner = _type(tp, where)
    if not metadata:
        return inner
    constraints: dict[str, Any] = {}
    for item in metadata:
        name = _CONSTRAINTS.get(type(item))
        if name is not None:
            constraints[name] = getattr(item, name)
        elif set(getattr(item, "__dict__", ())) == {"pattern"}:  # pydantic's, for a string
            constraints["pattern"] = item.pattern
        else:
            raise TypeError(f"{where}: no msgspec equivalent of {item!r}")
    return Annotated[inner, msgspec.Meta(**constraints)]


def _type(tp: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return struct_of(tp)
    if origin is Annotated:
        return _annotated(args[0], list(args[1:]), where)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return tuple[_type(args[0], where), ...]  # type: ignore[misc]
    if origin in (Union, types.UnionType):
        return Union[tuple(_type(arg, where) for arg in args)]  # noqa: UP007
    if origin is Literal or tp in _PLAIN:
        return tp
    raise TypeError(f"{where}: no msgspec equivalent of {tp!r}")


@cache
def decoder(model: type[BaseModel]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(struct_of(model))
