"""Parsing and validation of OpenAI request bodies.

Checked by hand rather than by pydantic: these run once per request on the hot path, and plain
checks cost a fraction of model validation while naming the offending field just as precisely.
Fields we do not know are ignored, as OpenAI does; fields we know but cannot honour (``n`` > 1,
``echo``, ``best_of`` > 1, ``suffix``, tools) are refused rather than silently answered wrongly;
a JSON ``response_format`` or ``logprobs`` are refused later, where a model's workers lack them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from schemas.cache_salt import MAX_CLIENT_SALT_CHARS
from schemas.events import StructuredOutput
from schemas.logprobs import MAX_TOP_LOGPROBS
from services.ingress.admission import PRIORITIES, Priority
from services.ingress.errors import InvalidRequest
from services.ingress.json_fields import (
    check_length,
    integers,
    json_object,
    optional_bool,
    optional_int,
    optional_number,
    range_error,
    required,
    type_error,
)
from services.ingress.response_format import parse_response_format

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
    cache_salt: str | None = None
    """The body's ``cache_salt`` (vLLM's): narrows prefix-cache sharing (``schemas.cache_salt``)."""
    structured_output: StructuredOutput | None = None
    """The body's ``response_format`` but text: the answer's required shape."""
    logprobs: int | None = None
    """Log probabilities of each answer token and of this many most likely tokens at its
    position (chat's ``top_logprobs``, the legacy API's ``logprobs``); None: none asked."""


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
    data = json_object(body)
    messages = _messages(required(data, "messages"))
    _refuse_chat_features(data)
    logprobs = _chat_logprobs(data)
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; the newer name wins.
    max_tokens = optional_int(data, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = optional_int(data, "max_tokens", minimum=1)
    return ChatRequest(messages, _params(data, max_tokens, logprobs))


def parse_completion_request(body: bytes) -> CompletionRequest:
    data = json_object(body)
    prompt = _prompt(required(data, "prompt"))
    if data.get("echo"):
        raise InvalidRequest("'echo' is not supported.", "echo")
    logprobs = _top_logprobs(data, "logprobs")
    if data.get("suffix"):
        raise InvalidRequest("'suffix' is not supported.", "suffix")
    best_of = optional_int(data, "best_of", minimum=1)
    if best_of not in (None, 1):
        raise InvalidRequest("Only best_of=1 is supported.", "best_of")
    max_tokens = optional_int(data, "max_tokens", minimum=1)
    return CompletionRequest(prompt, _params(data, max_tokens, logprobs))


def _params(data: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> Params:
    model = required(data, "model")
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    check_length("model", model, MAX_MODEL_CHARS)
    stream = optional_bool(data, "stream")
    include_usage = False
    options = data.get("stream_options")
    if options is not None:
        if not stream:
            raise InvalidRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
            )
        if not isinstance(options, dict):
            raise type_error("stream_options", "an object", options)
        include_usage = optional_bool(options, "include_usage", "stream_options.include_usage")
    n = optional_int(data, "n", minimum=1)
    if n not in (None, 1):
        raise InvalidRequest("Only n=1 is supported.", "n")
    user = data.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise type_error("user", "a string", user)
        check_length("user", user, MAX_SESSION_ID_CHARS)
    temperature = optional_number(data, "temperature", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise range_error("temperature", "between 0 and 2", temperature)
    top_p = optional_number(data, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise range_error("top_p", "greater than 0 and at most 1", top_p)
    return Params(
        model=model,
        stream=stream,
        include_usage=include_usage,
        user=user,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=optional_int(data, "seed", *_SEEDS),
        stop=_stop(data.get("stop")),
        stop_token_ids=_int_list(data, "stop_token_ids"),
        ignore_eos=optional_bool(data, "ignore_eos"),
        priority=None if data.get("priority") is None else _priority(data["priority"], "priority"),
        cache_salt=_cache_salt(data.get("cache_salt")),
        structured_output=parse_response_format(data.get("response_format")),
        logprobs=logprobs,
    )


def _cache_salt(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise type_error("cache_salt", "a string", value)
    if not value:  # as vLLM: an empty salt is a mistake, not "no salt"
        raise InvalidRequest("'cache_salt' must be a non-empty string.", "cache_salt")
    check_length("cache_salt", value, MAX_CLIENT_SALT_CHARS)
    return value


def _top_logprobs(data: dict[str, Any], field: str) -> int | None:
    """How many most likely tokens ``field`` asks for at each position (0: the answer's own
    log probabilities alone); None: absent or null."""
    value = data.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(field, "an integer", value)
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise range_error(field, f"between 0 and {MAX_TOP_LOGPROBS}", value)
    return value


def _chat_logprobs(data: dict[str, Any]) -> int | None:
    """Chat's ``logprobs`` (true: each answer token's) and ``top_logprobs`` (how many most
    likely tokens beside, which needs ``logprobs``), as one number; None: not asked."""
    wanted = optional_bool(data, "logprobs")
    top = _top_logprobs(data, "top_logprobs")
    if not wanted:
        if top:
            raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        return None
    return top or 0


def _refuse_chat_features(data: dict[str, Any]) -> None:
    """What a chat request may ask for that no engine here does: tool calls (a tool list is
    fine with ``tool_choice`` none, which asks for none)."""
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        if data.get(choice) not in (None, "none"):
            raise InvalidRequest(f"Only {choice}='none' is supported: no tool is called.", choice)
        if data.get(tools) and data.get(choice) != "none":
            raise InvalidRequest(
                f"'{tools}' is not supported (no tool is called) unless {choice} is 'none'.", tools
            )


def _messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list):
        raise type_error("messages", "an array", value)
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
            raise type_error(param, "an object", item)
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
        raise type_error(param, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidRequest("Only text content parts are supported.", f"{param}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise type_error(f"{param}[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        ids = integers(value)
        if ids is not None:
            return ids
        if len(value) == 1:
            (only,) = value
            if isinstance(only, str):
                return only
            ids = integers(only) if isinstance(only, list) and only else None
            if ids is not None:
                return ids
        elif all(isinstance(p, str | list) for p in value):
            raise InvalidRequest("Batched prompts are not supported: send one prompt.", "prompt")
    raise type_error(
        "prompt", "a non-empty string, array of token ids, or array of one of these", value
    )


def session_id(header: str | None, user: str | None) -> str | None:
    """The conversation a request belongs to: the x-session-id header, else ``user``."""
    if header:
        check_length("x-session-id", header, MAX_SESSION_ID_CHARS)
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
        check_length("stop", value, MAX_STOP_CHARS)
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(value)}.", "stop"
        )
    for i, stop in enumerate(value):
        check_length(f"stop[{i}]", stop, MAX_STOP_CHARS)
    return tuple(value)


def _int_list(data: dict[str, Any], name: str) -> tuple[int, ...]:
    value = data.get(name)
    if value is None:
        return ()
    ids = integers(value) if isinstance(value, list) else None
    if ids is None:
        raise type_error(name, "an array of integers", value)
    for i, token in enumerate(ids):
        if token < 0:
            raise range_error(f"{name}[{i}]", "a token id, at least 0", token)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"'{name}' accepts at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}.", name
        )
    return ids
