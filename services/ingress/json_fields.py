"""Typed fields read out of a JSON request body, each wrong one an OpenAI-style 400 that names
it (``param``) and says what was expected and what came."""

from __future__ import annotations

from typing import Any

import orjson

from services.ingress.errors import InvalidRequest

_EXACT_DOUBLE = 2.0**53


def json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly.)",
            None,
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", None)
    return data


def check_length(param: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(
            f"Invalid '{param}': string too long. Expected a string with maximum length "
            f"{limit}, but got a string with length {len(value)} instead.",
            param,
            code="string_above_max_length",
        )


def required(data: dict[str, Any], name: str) -> object:
    value = data.get(name)
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{name}'.", name)
    return value


def optional_bool(data: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = data.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise type_error(param or name, "a boolean", value)
    return value


def optional_int(
    data: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    number = integer(value)
    ranged = minimum is not None and maximum is not None
    bounds = f"between {minimum} and {maximum}" if ranged else f"at least {minimum}"
    if number is None:
        if type(value) is float and value.is_integer():  # an integer past 2**53 (or 64 bits)
            # Past what a double carries exactly: sent as an integer, it may be in range.
            raise range_error(name, "an integer (as a decimal number, within ±2**53)", value)
        raise type_error(name, "an integer", value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise range_error(name, bounds, number)
    return number


def integer(value: object) -> int | None:
    """``value`` as an integer, if it is one: JSON's 2.0 is (as JSON Schema has it, and the
    clients that send every number as a double), JSON's true is not (bool is an int in Python).
    A double is taken while exact (2**53), so that no integer the bus could not carry (past 64
    bits) comes of it."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) <= _EXACT_DOUBLE:
        return int(value)
    return None


def integers(values: list[Any]) -> tuple[int, ...] | None:
    """``values`` as integers, if all are (the common case, all ints, checked first)."""
    if all(type(t) is int for t in values):
        return tuple(values)
    ints = [integer(t) for t in values]
    return None if None in ints else tuple(i for i in ints if i is not None)


def optional_number(data: dict[str, Any], name: str, default: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if type(value) is not int and type(value) is not float:
        raise type_error(name, "a number", value)
    return float(value)


_JSON_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a decimal number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def type_error(param: str, expected: str, got: object) -> InvalidRequest:
    actual = _JSON_TYPE_NAMES.get(type(got), "null")
    return InvalidRequest(
        f"Invalid type for '{param}': expected {expected}, but got {actual} instead.", param
    )


def range_error(param: str, expected: str, got: object) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': expected {expected}, got {got}.", param)
