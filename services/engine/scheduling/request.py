"""One request's state inside the simulated engine."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.block_hash import ROOT_HASH, chain_block_hashes, hash_block
from services.engine.protocol import EngineRequest
from services.engine.scheduling.block_pool import BlockRef
from services.engine.scheduling.text import WordStream


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    prompt: Sequence[int]
    max_tokens: int
    stop_token_ids: frozenset[int]
    words: WordStream
    # Chained hashes of the full blocks of prompt + output, extended as output blocks fill.
    hashes: list[int]
    # The first block's parent: the request's cache salt (EngineRequest.root_hash).
    root_hash: int = ROOT_HASH
    output: list[int] = field(default_factory=list)
    # len(prompt) + len(output), kept as a field because the scheduler reads it for every request
    # in every step.
    num_tokens: int = 0
    # Tokens whose KV is computed; the rest of prompt + output is still to compute.
    num_computed: int = 0
    # Tokens to compute before the next token is sampled: the prompt, or after a preemption the
    # prompt and the output so far. Below it the request is prefilling, at or above it decoding.
    prefill_len: int = 0
    blocks: list[BlockRef] = field(default_factory=list)
    # Leading blocks already offered to the prefix cache.
    num_offered: int = 0
    running: bool = False
    # Prompt tokens found in the cache at first admission; reported with the first token.
    cached_tokens: int | None = None
    # The KV of the first ``prefill_len`` tokens, the partial last block's included, came with
    # the request from a prefill worker: it decodes from its first step if its full blocks are
    # still cached when it is admitted.
    handed_off: bool = False

    @classmethod
    def from_engine_request(cls, request: EngineRequest, block_size: int) -> SimRequest:
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id} has an empty prompt")
        root = request.root_hash
        hashes = list(request.block_hashes or chain_block_hashes(prompt, block_size, root))
        if len(hashes) != len(prompt) // block_size:
            raise ValueError(
                f"request {request.request_id} has {len(hashes)} block hashes for "
                f"{len(prompt)} tokens at block size {block_size}"
            )
        sampling = request.sampling
        seed = sampling.seed
        if seed is None and sampling.temperature == 0:
            # The unsalted chain: a greedy answer is the prompt's, whoever's cache holds it.
            plain = hashes if root == ROOT_HASH else chain_block_hashes(prompt, block_size)
            seed = _greedy_seed(prompt, plain, block_size, sampling.offset)
        elif seed is None:
            # crc32, not hash(): str hashes change with every interpreter run.
            seed = zlib.crc32(request.request_id.encode())
        words = WordStream(seed)
        # A migrated request keeps its id, so its seed: the text goes on where it broke off.
        words.skip(sampling.offset)
        return cls(
            request_id=request.request_id,
            prompt=prompt,
            max_tokens=sampling.max_tokens,
            stop_token_ids=frozenset(sampling.stop_token_ids),
            words=words,
            hashes=hashes,
            root_hash=root,
            num_tokens=len(prompt),
            prefill_len=len(prompt),
        )

    def append_token(self, token: int) -> None:
        self.output.append(token)
        self.num_tokens += 1

    def hashes_upto(self, num_blocks: int, block_size: int) -> list[int]:
        """The chain's first ``num_blocks`` hashes; those blocks' tokens must all be known."""
        hashes = self.hashes
        while len(hashes) < num_blocks:
            k = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            hashes.append(hash_block(parent, self._block_tokens(k, block_size)))
        return hashes

    def _block_tokens(self, k: int, block_size: int) -> Sequence[int]:
        start, end, split = k * block_size, (k + 1) * block_size, len(self.prompt)
        if end <= split:
            return self.prompt[start:end]
        if start >= split:
            return self.output[start - split : end - split]
        return [*self.prompt[start:], *self.output[: end - split]]


def _greedy_seed(prompt: Sequence[int], hashes: Sequence[int], block_size: int, offset: int) -> int:
    """Greedy decoding (temperature 0) is a function of the prompt alone: the same prompt, the
    same text, whichever request or worker it is. The prompt is the client's, without the
    ``offset`` tokens a migrated or handed-off request carries on it, so that its text goes on
    as it began. Its full blocks are already hashed (each hash covers its whole prefix); only the
    tokens after the last are read."""
    length = len(prompt) - offset
    full = length // block_size
    return hash_block(hashes[full - 1] if full else ROOT_HASH, prompt[full * block_size : length])
