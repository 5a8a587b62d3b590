"""A request moved to another worker, pure: its continuation from the tokens the client already
has, and when it may move no more."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from schemas.block_hash import chain_block_hashes, salt_root
from schemas.events import (
    WORKER_NAME_MAX,
    RequestFailed,
    RequestFinished,
    RequestSpec,
    TerminalEvent,
    Usage,
)

MIGRATION_LIMIT = 3
# RequestSpec.avoid_workers' bound.
AVOID_AT_MOST = 8


def avoiding(spec: RequestSpec, unheard: Collection[str]) -> RequestSpec:
    """``spec`` avoiding the workers this ingress hears late or not at all as well: a planner
    behind a slow link hears them on time and the others late, while the answer's tokens come
    here (docs/operations.md, "Three hosts"). Those its earlier attempts left come first."""
    # A registered id no WorkerName can hold (no provisioned worker has one) is left out: it
    # would make the request one no planner takes.
    named = sorted(w for w in unheard if 0 < len(w) <= WORKER_NAME_MAX)
    if not named:
        return spec
    avoid = tuple(dict.fromkeys((*spec.avoid_workers, *named)))[:AVOID_AT_MOST]
    if avoid == spec.avoid_workers:
        return spec
    return spec.model_copy(update={"avoid_workers": avoid})


def continued(
    spec: RequestSpec, delivered: Sequence[int], attempt: int, left: Sequence[str] = ()
) -> RequestSpec:
    """``spec`` (the request as the client sent it) continued after its ``delivered`` answer
    tokens: they end the prompt, the sampling goes on at their count, and the answer may have
    what is left of ``max_tokens``. The request keeps its id, so a seeded sampler its seed.
    ``left``: the workers its earlier attempts ran on, which the planner then avoids (the one
    caching its prompt is where a request that moved for silence would go straight back)."""
    prompt = (*spec.prompt_token_ids, *delivered)
    sampling = spec.sampling
    return spec.model_copy(
        update={
            "prompt_token_ids": prompt,
            "block_hashes": chain_block_hashes(prompt, spec.block_size, salt_root(spec.cache_salt)),
            "sampling": sampling.model_copy(
                update={
                    "max_tokens": sampling.max_tokens - len(delivered),
                    "offset": len(delivered),
                }
            ),
            "attempt": attempt,
            "avoid_workers": tuple(dict.fromkeys(left))[-AVOID_AT_MOST:],
        }
    )


def without_worker(
    spec: RequestSpec, delivered: int, request_id: str, session_id: str | None, source: str
) -> TerminalEvent | None:
    """How a request whose worker is gone ends without another one, if it does: every token
    it may have was delivered (only the terminal event was lost)."""
    if delivered < spec.sampling.max_tokens:
        return None
    return RequestFinished(
        source=source,
        request_id=request_id,
        session_id=session_id,
        worker_id="",
        finish_reason="length",
        usage=Usage(prompt_tokens=len(spec.prompt_token_ids), completion_tokens=delivered),
        ttft_ms=0.0,
        e2e_ms=0.0,
        tenant=spec.tenant,
        model=spec.model,
    )


def unresumable(
    spec: RequestSpec, delivered: int, request_id: str, session_id: str | None, source: str
) -> RequestFailed | None:
    """How a request ends that cannot continue on another worker, if it cannot: its answer has
    a response_format and the client has some of it. An engine's grammar starts at an answer's
    first token and cannot take up one begun elsewhere (an engine refuses such a continuation
    too); from the start, on another worker, it can."""
    wanted = spec.sampling.structured_output
    if wanted is None or not delivered:
        return None
    return RequestFailed(
        source=source,
        request_id=request_id,
        session_id=session_id,
        code="worker_lost",
        message=f"the request lost its worker after {delivered} tokens, and an answer with "
        f"response_format {wanted.type} cannot continue on another worker: retry the request",
        completion_tokens=delivered,
    )


def limit_reached(
    limit: int, delivered: int, request_id: str, session_id: str | None, source: str
) -> RequestFailed:
    return RequestFailed(
        source=source,
        request_id=request_id,
        session_id=session_id,
        code="worker_lost",
        message=f"the request lost its worker {limit + 1} times (LANEWAY_MIGRATION_LIMIT is "
        f"{limit}) after {delivered} tokens: retry the request",
        completion_tokens=delivered,
    )
