"""How a request continues on its decode engine after a prefill engine computed its prompt and
sampled its first token (disaggregation), in one pure function that the live decode worker and
the offline replay share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.block_hash import hash_block
from schemas.events import FinishReason
from services.engine.protocol import EngineRequest, RequestOutput


@dataclass(frozen=True, slots=True)
class Continuation:
    # The first token, as the decode side's own first output of the request.
    first: RequestOutput
    # The rest for the decode engine: the prompt and the first token, the remaining tokens to
    # sample; None when the first token was also the last.
    rest: EngineRequest | None
    # Leading tokens of ``rest``'s prompt whose KV the prefill engine computed (the whole
    # original prompt); the first token's KV is the decode engine's to compute.
    handed_off_tokens: int


def handoff_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens whose KV a whole-prompt hand-off moves to a decode engine that caches
    ``cached_blocks`` leading blocks of it: all it lacks, the partial last block's included."""
    return max(0, prompt_tokens - cached_blocks * block_size)


def continuation(
    request: EngineRequest,
    first_token: int,
    block_size: int,
    finish_reason: FinishReason | None = None,
    cached_tokens: int | None = None,
    prompt: Sequence[int] | None = None,
) -> Continuation:
    """``request``: the whole request as the decode side holds it (its ``block_hashes`` at
    ``block_size``, or none to let the engine compute them); ``finish_reason``: set when the
    first token already ended the answer ("stop"); ``cached_tokens``: the prompt tokens the
    prefill engine found cached; ``prompt``: the prompt followed by the first token, for a caller
    with a cheaper form of it than a copy."""
    sampling = request.sampling
    last = finish_reason is not None or sampling.max_tokens <= 1
    first = RequestOutput(
        request.request_id,
        (first_token,),
        finished=last,
        finish_reason=finish_reason or ("length" if last else None),
        cached_tokens=cached_tokens,
    )
    handed_off = len(request.prompt_token_ids)
    if last:
        return Continuation(first, None, handed_off)
    tokens = prompt if prompt is not None else (*request.prompt_token_ids, first_token)
    hashes = request.block_hashes
    # Given hashes must cover every full block: the first token may have completed one.
    if hashes and len(tokens) % block_size == 0:
        hashes = (*hashes, hash_block(hashes[-1], tokens[len(tokens) - block_size :]))
    rest = EngineRequest(
        request.request_id,
        tokens,
        # The first token was sampled there: a seeded sampler goes on from the second.
        sampling.model_copy(
            update={"max_tokens": sampling.max_tokens - 1, "offset": sampling.offset + 1}
        ),
        hashes,
        request.root_hash,
    )
    return Continuation(first, rest, handed_off)
