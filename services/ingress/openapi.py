"""The ingress's OpenAPI 3.1 document (``GET /openapi.json``), built from models of what the
parser in openai_models takes and what responses.py and errors.py write.

The request models describe; they do not parse (the hand-written parser does, for speed), so
they take its limits from the same constants, and the fuzz test (tests/ingress/test_fuzz_live.py)
checks every answer of the live API against this document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from schemas.cache_salt import MAX_CLIENT_SALT_CHARS
from schemas.events import FinishReason
from schemas.logprobs import MAX_TOP_LOGPROBS
from services.ingress.admission import Priority
from services.ingress.openai_models import (
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_SESSION_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
)
from services.ingress.response_format import MAX_SCHEMA_BYTES, NAME_PATTERN
from services.ingress.settings import IngressApiSettings

Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]


class _Doc(BaseModel):
    # Unknown fields are ignored, as OpenAI does.
    model_config = ConfigDict(extra="allow")


class TextPart(_Doc):
    type: Literal["text"]
    text: str


class Message(_Doc):
    role: Literal["system", "developer", "user", "tool"]
    content: str | list[TextPart] = Field(description="the text, or text parts joined by newlines")


class AssistantTurn(_Doc):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = Field(
        None, description="null or absent: a turn that only called tools"
    )


class StreamOptions(_Doc):
    include_usage: bool | None = None


class TextFormat(_Doc):
    type: Literal["text"]


class JsonObjectFormat(_Doc):
    type: Literal["json_object"]


class JsonSchema(_Doc):
    name: str = Field(pattern=NAME_PATTERN)
    schema_: dict[str, Any] = Field(
        alias="schema",
        description=f"a JSON Schema, at most {MAX_SCHEMA_BYTES} bytes as compact JSON",
    )
    strict: bool | None = Field(None, description="either way, the schema is held to")
    description: str | None = None


class JsonSchemaFormat(_Doc):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat,
    Field(
        discriminator="type",
        description="json_object and json_schema only where every worker of the model does "
        "structured outputs (the vllm engine); else 400",
    ),
]


_LOGPROBS = (
    "each answer token's log probability; only where every worker of the model gives them "
    "(the vllm engine), else 400"
)


class _Params(_Doc):
    model: str = Field(max_length=MAX_MODEL_CHARS, description="a served model's name")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: Literal[1] | None = None
    user: str | None = Field(
        None, max_length=MAX_SESSION_ID_CHARS, description="the session, unless x-session-id"
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    priority: Priority | None = Field(
        None, description="who waits first and is shed last; the x-laneway-priority header wins"
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CLIENT_SALT_CHARS,
        description="prefix-cache blocks are shared only between requests of one cache group "
        "with the same cache_salt (vLLM's field): it narrows sharing, never widens it",
    )
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_Params):
    messages: list[Message | AssistantTurn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description=_LOGPROBS)
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="most likely tokens beside; needs logprobs"
    )
    tools: list[Any] | None = Field(None, description="refused unless tool_choice is none")
    tool_choice: Literal["none"] | None = None
    functions: list[Any] | None = Field(None, description="refused unless function_call is none")
    function_call: Literal["none"] | None = None


class CompletionRequest(_Params):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string or token ids, or an array of exactly one of these"
    )
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description=f"most likely tokens beside; {_LOGPROBS}"
    )
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopChatLogprob):
    top_logprobs: list[TopChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: Literal[0]
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class CompletionChoice(BaseModel):
    index: Literal[0]
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1, max_length=1)
    usage: Usage


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1, max_length=1)
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    ChatCompletion,
    Completion,
    ModelList,
    ErrorResponse,
)
# Every failure a completion may answer with; 401/403 only where the API takes keys.
_ERRORS = {
    "400": "invalid request (a field named in `param`), or a context longer than the model's",
    "401": "no API key, or one not known",
    "403": "the API key may not use this endpoint",
    "404": "the model is not served",
    "408": "the request's headers did not arrive within LANEWAY_HEADER_TIMEOUT_S",
    "413": "the body is larger than LANEWAY_MAX_BODY_BYTES",
    "415": "the body is not JSON",
    "429": "the cluster is at capacity, or the tenant at its limits: retry after Retry-After",
    "431": "the headers are over LANEWAY_MAX_HEADER_BYTES or LANEWAY_MAX_HEADERS",
    "500": "an engine or server error",
    "502": "the worker was lost, or its answer incomplete",
    "503": "no worker can serve it, the server stopped before the request finished, or the "
    "unfinished headers of all clients are at LANEWAY_HEAD_BUFFER_BYTES: retry after Retry-After",
    "504": "not done within LANEWAY_REQUEST_TIMEOUT_S",
}


def openapi_document(settings: IngressApiSettings, vocab_size: int) -> bytes:
    """The document for an API serving ``settings``' models with a tokenizer of ``vocab_size``
    token ids."""
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        request = schemas[name]
        properties = request["properties"]
        properties["model"]["enum"] = list(settings.served_model_names)
        properties["stop_token_ids"]["anyOf"][0]["items"] = token
        if settings.max_model_len is not None:
            # Less in truth: the prompt takes its share of the context.
            for field in ("max_tokens", "max_completion_tokens"):
                if field in properties:
                    properties[field]["anyOf"][0]["maximum"] = settings.max_model_len
        request["dependentSchemas"] = {
            "stream_options": {
                "anyOf": [
                    {"properties": {"stream_options": {"type": "null"}}},
                    {"properties": {"stream": {"const": True}}, "required": ["stream"]},
                ]
            }
        }
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    text = {"type": "string", "minLength": 1}
    prompt[0] = text
    prompt[1] = {"type": "array", "items": token, "minItems": 1}
    prompt[2] = {"type": "array", "items": text, "minItems": 1, "maxItems": 1}
    prompt[3] = {
        "type": "array",
        "items": {"type": "array", "items": token, "minItems": 1},
        "minItems": 1,
        "maxItems": 1,
    }
    document = {
        "openapi": "3.1.0",
        "info": {"title": "Laneway", "version": "1", "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/chat/completions": _completion("ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": _completion("CompletionRequest", "Completion"),
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {"200": _json("the served models", "ModelList")},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        "200": _json("the served model", "Model"),
                        "404": _json("no served model of that name", "ErrorResponse"),
                    },
                }
            },
        },
        "components": {"schemas": schemas},
    }
    return orjson.dumps(document)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _completion(request: str, answer: str) -> dict[str, Any]:
    ok = _json("the answer; with stream: true, server-sent events instead", answer)
    # One server-sent event: a chunk of the answer as JSON, an error's body, or [DONE].
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "description": f"a JSON chunk of {answer}, or [DONE]"}
        },
    }
    ok["content"]["text/event-stream"] = {"schema": event}
    retry = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
    errors = {code: _json(text, "ErrorResponse") for code, text in _ERRORS.items()}
    errors["429"]["headers"] = retry
    return {
        "post": {
            "operationId": request.removesuffix("Request"),
            "parameters": [
                _header("x-session-id", {"type": "string", "maxLength": MAX_SESSION_ID_CHARS}),
                _header("x-laneway-priority", {"enum": ["high", "normal", "low"]}),
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **errors},
        }
    }


def _header(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": schema}
