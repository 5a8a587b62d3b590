"""How a request's answer is sampled, as the client asked for it: carried in its spec from the
ingress to the engine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.envelope import Frozen, TokenIds
from schemas.logprobs import MAX_TOP_LOGPROBS


class StructuredOutput(Frozen):
    """The shape the answer must take (OpenAI's ``response_format``), enforced while sampling by
    an engine that does structured outputs (vLLM's)."""

    type: Literal["json_schema", "json_object"] = Field(
        description="json_schema: JSON valid against `schema`; json_object: any JSON object"
    )
    json_schema: str | None = Field(
        default=None,
        description="the JSON Schema as compact JSON text, its keys in the client's order (the "
        "answer's properties come in that order); None for json_object",
    )


class SamplingParams(Frozen):
    """Generation settings as the client asked for them (OpenAI semantics)."""

    max_tokens: int = Field(ge=1, description="maximum number of generated tokens")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus probability mass")
    seed: int | None = Field(
        default=None,
        ge=-(2**63),
        le=2**63 - 1,
        description="sampling seed; fixed seed, fixed output",
    )
    stop: tuple[str, ...] = Field(default=(), description="generation ends before any of these")
    stop_token_ids: TokenIds = Field(default=(), description="generation ends after any of these")
    ignore_eos: bool = Field(default=False, description="keep generating past end-of-sequence")
    offset: int = Field(
        default=0,
        ge=0,
        description="answer tokens already generated, the last of the prompt (a migrated "
        "request's continuation): sampling continues at this position of the answer",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="give each answer token's log probability and this many most likely tokens "
        "at its position; None: none",
    )
    structured_output: StructuredOutput | None = Field(
        default=None,
        description="the answer's required shape; None: free text. An engine cannot resume "
        "it mid-answer: a continuation (offset > 0) with one is refused",
    )
