"""OpenAI's ``response_format``, parsed: free text, any JSON object, or JSON valid against a JSON
Schema. The last two become the request's :class:`~schemas.events.StructuredOutput`, which only
an engine that does structured outputs serves (:mod:`services.ingress.worker_features`)."""

from __future__ import annotations

import re

import orjson

from schemas.events import StructuredOutput
from services.ingress.errors import InvalidRequest
from services.ingress.json_fields import range_error, type_error

# The schema rides on every event of its request (the spec) and is compiled into a grammar on
# the worker: far above a real response schema (a few KiB), far below what strains either.
MAX_SCHEMA_BYTES = 65_536
# OpenAI's rule for json_schema.name.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
TYPES = ("text", "json_object", "json_schema")
_JSON_OBJECT = StructuredOutput(type="json_object")


def parse_response_format(value: object) -> StructuredOutput | None:
    """``response_format`` as the worker gets it; None: free text (absent or ``text``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise type_error("response_format", "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _JSON_OBJECT
    if kind != "json_schema":
        raise InvalidRequest(
            f"Invalid value for 'response_format.type': expected one of {', '.join(TYPES)}.",
            "response_format.type",
        )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if spec is None:
        raise InvalidRequest(f"Missing required parameter: '{param}'.", param)
    if not isinstance(spec, dict):
        raise type_error(param, "an object", spec)
    name = spec.get("name")
    if name is None:
        raise InvalidRequest(f"Missing required parameter: '{param}.name'.", f"{param}.name")
    if not isinstance(name, str):
        raise type_error(f"{param}.name", "a string", name)
    if not _NAME.fullmatch(name):  # not match: its $ also matches before a final newline
        raise range_error(
            f"{param}.name", "1 to 64 of a-z, A-Z, 0-9, underscores and dashes", repr(name)
        )
    strict = spec.get("strict")
    # Accepted either way: an engine that does structured outputs always holds to the schema.
    if strict is not None and not isinstance(strict, bool):
        raise type_error(f"{param}.strict", "a boolean", strict)
    schema = spec.get("schema")
    if schema is None:
        raise InvalidRequest(f"Missing required parameter: '{param}.schema'.", f"{param}.schema")
    if not isinstance(schema, dict):
        raise type_error(f"{param}.schema", "an object", schema)
    # Compact, keys in the client's order: a JSON Schema's property order is the order the
    # answer gives them in, so sorting would change the answer.
    text = orjson.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(
            f"Invalid '{param}.schema': {len(text)} bytes as JSON, more than the "
            f"{MAX_SCHEMA_BYTES} taken.",
            f"{param}.schema",
        )
    return StructuredOutput(type="json_schema", json_schema=text.decode())
