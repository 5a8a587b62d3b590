"""Parsing and validation of OpenAI request bodies.

Checked by hand rather than by pydantic: these run once per request on the hot path, and plain
checks cost a fraction of model validation while naming the offending field just as precisely.
Fields we do not know are ignored, as OpenAI does; fields we know but cannot honour (``n`` > 1,
``logprobs``, ``echo``, ``best_of`` > 1, ``suffix``, tools, a JSON ``response_format``) are refused
rather than silently answered wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from services.ingress.admission import PRIORITIES, Priority
from services.ingress.errors import InvalidRequest

MAX_STOP_SEQUENCES = 4
# Each stop string is matched against the text at every token, on the worker.
MAX_STOP_CHARS = 1024
# A session id (``user`` or the x-session-id header) is an etcd key and rides on every event of
# its requests: a 900 KB one took etcd past its request limit.
MAX_SESSION_ID_CHARS = 256
# Far past any served name; an unknown one is echoed in its 404 and the access log.
MAX_MODEL_CHARS = 256
# OpenAI's own limit on the messages of one chat.
MAX_MESSAGES = 2048
# Far more than any model's special tokens; the list travels with the request to its worker.
MAX_STOP_TOKEN_IDS = 1024
_EXACT_DOUBLE = 2.0**53
# A 64-bit signed seed, as vLLM takes it.
_SEEDS = (-(2**63), 2**63 - 1)
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Params:
    """What both endpoints share. ``max_tokens`` stays None when the client left it out: its
    default depends on the prompt length and the server settings."""

    model: str
    stream: bool
    include_usage: bool
    user: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    priority: Priority | None = None
    """The body's ``priority``; None: not given (the header's, else normal)."""


@dataclass(frozen=True, slots=True)
class ChatRequest:
    # The field OpenAI blames for an over-long prompt.
    prompt_param: ClassVar[str] = "messages"
    messages: tuple[Message, ...]
    params: Params


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt_param: ClassVar[str] = "prompt"
    prompt: str | tuple[int, ...]
    params: Params


ParsedRequest = ChatRequest | CompletionRequest


def parse_chat_request(body: bytes) -> ChatRequest:
    data = _json_object(body)
    messages = _messages(_required(data, "messages"))
    _refuse_chat_features(data)
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; the newer name wins.
    max_tokens = _optional_int(data, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _optional_int(data, "max_tokens", minimum=1)
    return ChatRequest(messages, _params(data, max_tokens))


def parse_completion_request(body: bytes) -> CompletionRequest:
    data = _json_object(body)
    prompt = _prompt(_required(data, "prompt"))
    if data.get("echo"):
        raise InvalidRequest("'echo' is not supported.", "echo")
    # An integer here, where 0 asks for the sampled tokens' own log probabilities.
    if data.get("logprobs") is not None and data["logprobs"] is not False:
        raise InvalidRequest("'logprobs' is not supported.", "logprobs")
    if data.get("suffix"):
        raise InvalidRequest("'suffix' is not supported.", "suffix")
    best_of = _optional_int(data, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise InvalidRequest("Only best_of=1 is supported.", "best_of")
    return CompletionRequest(prompt, _params(data, _optional_int(data, "max_tokens", minimum=1)))


def _json_object(body: bytes) -> dict[str, Any]:
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


def _params(data: dict[str, Any], max_tokens: int | None) -> Params:
    model = _required(data, "model")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    _check_length("model", model, MAX_MODEL_CHARS)
    stream = _optional_bool(data, "stream")
    include_usage = False
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
            )
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object", options)
        include_usage = _optional_bool(options, "include_usage", "stream_options.include_usage")
    n = _optional_int(data, "n", minimum=1)
    if n not in (None, 1):
        raise InvalidRequest("Only n=1 is supported.", "n")
    user = data.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise _type_error("user", "a string", user)
        _check_length("user", user, MAX_SESSION_ID_CHARS)
    temperature = _optional_number(data, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise _range_error("temperature", "between 0 and 2", temperature)
    top_p = _optional_number(data, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise _range_error("top_p", "greater than 0 and at most 1", top_p)
    return Params(
        model=model,
        stream=stream,
        include_usage=include_usage,
        user=user,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=_optional_int(data, "seed", *_SEEDS),
        stop=_stop(data.get("stop")),
        stop_token_ids=_int_list(data, "stop_token_ids"),
        ignore_eos=_optional_bool(data, "ignore_eos"),
        priority=None if data.get("priority") is None else _priority(data["priority"], "priority"),
    )


def _refuse_chat_features(data: dict[str, Any]) -> None:
    """What a chat request may ask for that no engine here does: log probabilities, tool calls
    (a tool list is fine with ``tool_choice`` none, which asks for none), JSON output."""
    if data.get("logprobs") is not None and data["logprobs"] is not False:
        raise InvalidRequest("'logprobs' is not supported.", "logprobs")
    if data.get("top_logprobs") not in (None, 0):
        raise InvalidRequest("'top_logprobs' is not supported.", "top_logprobs")
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        if data.get(choice) not in (None, "none"):
            raise InvalidRequest(f"Only {choice}='none' is supported: no tool is called.", choice)
        if data.get(tools) and data.get(choice) != "none":
            raise InvalidRequest(
                f"'{tools}' is not supported (no tool is called) unless {choice} is 'none'.", tools
            )
    response_format = data.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise InvalidRequest(
            "Only response_format {'type': 'text'} is supported.", "response_format"
        )


def _messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise _type_error("messages", "an array", value)
    if not value:
        raise InvalidRequest("'messages' must contain at least one message.", "messages")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequest(
            f"Invalid 'messages': array too long. Expected an array with maximum length "
            f"{MAX_MESSAGES}, but got an array with length {len(value)} instead.",
            "messages",
            code="array_above_max_length",
        )
    messages = []
    for i, item in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(item, dict):
            raise _type_error(param, "an object", item)
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"Invalid value for '{param}.role': expected one of {', '.join(sorted(_ROLES))}.",
                f"{param}.role",
            )
        # "developer" is OpenAI's newer name for the system role; templates know only "system".
        messages.append(
            Message("system" if role == "developer" else role, _content(item, role, param))
        )
    return tuple(messages)


def _content(message: dict[str, Any], role: str, param: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    # An assistant turn that only called tools has no content.
    if content is None and role == "assistant":
        return ""
    param = f"{param}.content"
    if not isinstance(content, list):
        raise _type_error(param, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequest("Only text content parts are supported.", f"{param}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{param}[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        ids = _integers(value)
        if ids is not None:
            return ids
        if len(value) == 1:
            (only,) = value
            if isinstance(only, str):
                return only
            ids = _integers(only) if isinstance(only, list) and only else None
            if ids is not None:
                return ids
        elif all(isinstance(p, str | list) for p in value):
            raise InvalidRequest("Batched prompts are not supported: send one prompt.", "prompt")
    raise _type_error(
        "prompt", "a non-empty string, array of token ids, or array of one of these", value
    )


def session_id(header: str | None, user: str | None) -> str | None:
    """The conversation a request belongs to: the x-session-id header, else ``user``."""
    if header:
        _check_length("x-session-id", header, MAX_SESSION_ID_CHARS)
        return header
    return user


def request_priority(header: str | None, body: Priority | None) -> Priority:
    """Who waits first and is shed last: the x-laneway-priority header (a gateway in front may
    set it for its clients), else the body's ``priority``, else normal."""
    if header is not None:
        return _priority(header.strip().lower(), "x-laneway-priority")
    return body or "normal"


def _priority(value: object, param: str) -> Priority:
    for priority in PRIORITIES:
        if value == priority:
            return priority
    raise InvalidRequest(
        f"Invalid value for '{param}': expected one of {', '.join(PRIORITIES)}.", param
    )


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        _check_length("stop", value, MAX_STOP_CHARS)
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}.", "stop"
        )
    for i, stop in enumerate(value):
        _check_length(f"stop[{i}]", stop, MAX_STOP_CHARS)
    return tuple(value)


def _check_length(param: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(
            f"Invalid '{param}': string too long. Expected a string with maximum length "
            f"{limit}, but got a string with length {len(value)} instead.",
            param,
            code="string_above_max_length",
        )


def _required(data: dict[str, Any], name: str) -> object:
    value = data.get(name)
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{name}'.", name)
    return value


def _optional_bool(data: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = data.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _type_error(param or name, "a boolean", value)
    return value


def _optional_int(
    data: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    number = _integer(value)
    ranged = minimum is not None and maximum is not None
    bounds = f"between {minimum} and {maximum}" if ranged else f"at least {minimum}"
    if number is None:
        if type(value) is float and value.is_integer():  # an integer past 2**53 (or 64 bits)
            raise _range_error(name, bounds if ranged else "an integer within ±2**53", value)
        raise _type_error(name, "an integer", value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise _range_error(name, bounds, number)
    return number


def _integer(value: object) -> int | None:
    """``value`` as an integer, if it is one: JSON's 2.0 is (as JSON Schema has it, and the
    clients that send every number as a double), JSON's true is not (bool is an int in Python).
    A double is taken while exact (2**53), so that no integer the bus could not carry (past 64
    bits) comes of it."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer() and abs(value) <= _EXACT_DOUBLE:
        return int(value)
    return None


def _integers(values: list[Any]) -> tuple[int, ...] | None:
    """``values`` as integers, if all are (the common case, all ints, checked first)."""
    if all(type(t) is int for t in values):
        return tuple(values)
    ints = [_integer(t) for t in values]
    return None if None in ints else tuple(i for i in ints if i is not None)


def _optional_number(data: dict[str, Any], name: str, default: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if type(value) is not int and type(value) is not float:
        raise _type_error(name, "a number", value)
    return float(value)


def _int_list(data: dict[str, Any], name: str) -> tuple[int, ...]:
    value = data.get(name)
    if value is None:
        return ()
    ids = _integers(value) if isinstance(value, list) else None
    if ids is None:
        raise _type_error(name, "an array of integers", value)
    for i, token in enumerate(ids):
        if token < 0:
            raise _range_error(f"{name}[{i}]", "a token id, at least 0", token)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"'{name}' accepts at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}.", name
        )
    return ids


_JSON_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a decimal number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def _type_error(param: str, expected: str, got: object) -> InvalidRequest:
    actual = _JSON_TYPE_NAMES.get(type(got), "null")
    return InvalidRequest(
        f"Invalid type for '{param}': expected {expected}, but got {actual} instead.", param
    )


def _range_error(param: str, expected: str, got: object) -> InvalidRequest:
    return InvalidRequest(f"Invalid value for '{param}': expected {expected}, got {got}.", param)
