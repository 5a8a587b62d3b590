"""Log probabilities of an answer's tokens, as an engine that gives them reports them (vLLM's):
carried with the tokens from the worker to the ingress, which writes them in OpenAI's shapes."""

from __future__ import annotations

from pydantic import Field

from schemas.envelope import Frozen

# OpenAI's bound on top_logprobs (vLLM's too, by default).
MAX_TOP_LOGPROBS = 20


class TopLogprob(Frozen):
    """One of the most likely tokens at a position."""

    token_id: int = Field(ge=0)
    token: str = Field(description="its text alone (a partial character shows as U+FFFD)")
    logprob: float


class TokenLogprob(Frozen):
    """One answer token's log probability, and the most likely tokens at its position."""

    token: str = Field(description="its text alone (a partial character shows as U+FFFD)")
    logprob: float
    top: tuple[TopLogprob, ...] = Field(
        default=(), max_length=MAX_TOP_LOGPROBS, description="most likely first"
    )
