"""What an ingress hears on core NATS while a request runs: where each attempt was placed, and
each engine step's new tokens (no stream stores them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.envelope import Envelope, Frozen, TokenIds, attempt_field
from schemas.logprobs import TokenLogprob


class RequestPlaced(Envelope):
    """The planner sent attempt ``attempt`` of the request to ``worker_id``: told to the
    request's ingress, which takes that attempt's tokens and terminal from that worker only."""

    type: Literal["RequestPlaced"] = "RequestPlaced"
    worker_id: str = Field(description="worker that generates the answer (decodes)")
    attempt: int = attempt_field()


class TokenRun(Frozen):
    """One request's tokens of one engine step, in a :class:`TokenBatch` (which holds several
    of a request's where steps came faster than the worker's token interval)."""

    request_id: str = Field(max_length=64)
    attempt: int = attempt_field()
    index: int = Field(ge=0, description="position of the first token in the completion")
    token_ids: TokenIds
    text: str = Field(description="detokenized text of `token_ids`, stop strings removed")
    logprobs: tuple[TokenLogprob, ...] = Field(
        default=(), description="one for each of `token_ids` where the request asked for them"
    )


class TokenBatch(Envelope):
    """One engine step's new tokens for every request of one ingress on one worker (steps
    faster than the worker's token interval: those since its last batch): one message per step
    per ingress instead of one per request (the ingress hands each run to its
    request as a ``TokensGenerated``)."""

    type: Literal["TokenBatch"] = "TokenBatch"
    worker_id: str
    runs: tuple[TokenRun, ...]
