"""The step-driven engine protocol that the live workers and the offline simulator both drive.

An engine never sleeps or does I/O: ``step`` runs one scheduler iteration and says how long it took
(measured for a real engine, modelled for ``sim``). The caller decides what to do with that time:
the live worker waits it out (divided by a speed-up), the offline simulator advances its clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas.events import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    # Chained hashes of the prompt's full blocks at the engine's block size; empty means
    # "compute them yourself".
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: Literal["stop", "length"] | None = None
    # Set on the first output of a request: prompt tokens found in the prefix cache.
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


KvChange = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    waiting_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass(slots=True)
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    kv_changes: list[KvChange] = field(default_factory=list)
    # Wall time the step takes on the modelled (sim) or real hardware, in seconds.
    duration_s: float = 0.0
    # New prompt tokens computed in this step (not served from cache).
    prefill_tokens: int = 0


class Engine(Protocol):
    block_size: int
    kv_blocks_total: int
    max_num_seqs: int

    def add_request(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if the engine does not hold it."""
        ...

    def step(self) -> StepResult: ...

    def has_work(self) -> bool: ...

    def load(self) -> EngineLoad: ...


class KvPortable(Protocol):
    """An engine whose cached prompt blocks can move to another engine of the same model: a
    prefill worker exports, a decode worker imports (disaggregation)."""

    def export_prefix(self, block_hashes: Sequence[int]) -> tuple[int, bytes]:
        """The leading blocks of ``block_hashes`` cached here: how many, and their KV serialized
        (empty for an engine that only models its KV)."""
        ...

    def import_prefix(self, block_hashes: Sequence[int], payload: bytes) -> int:
        """Cache the blocks another engine exported (``payload`` from its ``export_prefix``); how
        many leading ``block_hashes`` are cached afterwards. Their ``BlocksStored`` changes come
        with the next step's result."""
        ...
