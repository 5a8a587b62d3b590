"""What every engine driven by `sim`'s scheduler and block accounting shares: the request set,
admission checks, advancing a scheduled batch, and the load and cache views. Engines differ only
in how a step's tokens come about (modelled for `sim`, computed for `torch`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from services.engine.protocol import (
    EngineCapabilities,
    EngineLoad,
    EngineRequest,
    RequestOutput,
    refuse_unsupported,
)
from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.config import SimConfig
from services.engine.scheduling.decode_run import DecodeRun, StepSeconds, decode_run
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.request import SimRequest
from services.engine.scheduling.scheduler import Batch, Scheduler


class ScheduledEngine:
    # The engine's name in refusals: LANEWAY_ENGINE's value.
    engine_kind: ClassVar[str]
    capabilities: EngineCapabilities
    # The LoRA adapters resident, least recently used first (the sim's; the torch engine
    # holds none).
    held_loras: tuple[str, ...] = ()

    def __init__(self, config: SimConfig, pool: BlockPool, kv: KvCacheManager) -> None:
        self.block_size = config.block_size
        self.kv_blocks_total = config.num_gpu_blocks
        self.max_num_seqs = config.max_num_seqs
        # The KV of every token but the last sampled one must fit in the pool at once.
        self.max_model_len = config.num_gpu_blocks * config.block_size
        self._pool = pool
        self._kv = kv
        self._scheduler = Scheduler(config, kv)
        self._requests: dict[str, SimRequest] = {}

    def _new_request(self, request: EngineRequest) -> SimRequest:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already in the engine")
        refuse_unsupported(request, self.engine_kind, self.capabilities.max_loras)
        req = SimRequest.from_engine_request(request, self.block_size)
        self._check(req)
        # The KV of every token but the last sampled one; a request that can never fit would be
        # preempted and readmitted forever.
        needed_blocks = -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)
        if needed_blocks > self.kv_blocks_total:
            raise ValueError(
                f"request {request.request_id} needs {needed_blocks} KV blocks, "
                f"the engine has {self.kv_blocks_total}"
            )
        return req

    def _check(self, req: SimRequest) -> None:
        """Raise ValueError for a request this engine can never serve (subclasses add checks)."""

    def _admit(self, req: SimRequest) -> None:
        self._requests[req.request_id] = req
        self._scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._scheduler.abort(req)
        self._forget(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        """A request left the engine; subclasses drop what they keep beside it."""

    def _stop_token_ids(self, req: SimRequest) -> frozenset[int]:
        return req.stop_token_ids

    def _advance(
        self, batch: Batch, next_token: Callable[[SimRequest], int]
    ) -> list[RequestOutput]:
        """Account a computed batch: cache the blocks it filled, and give every request it
        brought to the end of its sequence its next token."""
        kv = self._kv
        outputs: list[RequestOutput] = []
        finished: list[SimRequest] = []
        for req, num_new in batch.scheduled:
            req.num_computed += num_new
            kv.cache_computed(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that does not reach the end of the prompt
            out = self._emit(req, next_token(req))
            outputs.append(out)
            if out.finished:
                finished.append(req)
        if finished:
            self._retire(finished)
        return outputs

    def _retire(self, finished: list[SimRequest]) -> None:
        self._scheduler.finish(finished)
        for req in finished:
            del self._requests[req.request_id]
            self._forget(req.request_id)

    def _decode_run(self, step_s: StepSeconds, start: float, until: float) -> DecodeRun | None:
        """The decode steps from ``start`` that begin before ``until``, at once (see
        :func:`decode_run`); the requests the last one ended leave the engine."""
        run = decode_run(self._scheduler, self._kv, step_s, self._stop_token_ids, start, until)
        if run is not None and run.finished:
            self._retire(run.finished)
        return run

    def _emit(self, req: SimRequest, token: int) -> RequestOutput:
        req.append_token(token)
        # Only one output can carry the first token, preempted or not.
        cached_tokens = req.cached_tokens if len(req.output) == 1 else None
        # Length before stop, as vLLM checks them.
        if len(req.output) >= req.max_tokens:
            return RequestOutput(req.request_id, (token,), True, "length", cached_tokens)
        if token in self._stop_token_ids(req):
            return RequestOutput(req.request_id, (token,), True, "stop", cached_tokens)
        return RequestOutput(req.request_id, (token,), cached_tokens=cached_tokens)

    def has_work(self) -> bool:
        return bool(self._requests)

    def load(self) -> EngineLoad:
        counts = self.load_counts()
        return EngineLoad(*counts, kv_blocks_total=self.kv_blocks_total, loras=self.held_loras)

    def load_counts(self) -> tuple[int, int, int, int]:
        """:meth:`load`'s running and waiting requests, waiting prefill tokens and KV blocks in
        use, without the object: an offline replay reads them of every worker at each arrival."""
        scheduler = self._scheduler
        return (
            len(scheduler.running),
            len(scheduler.waiting),
            scheduler.pending_prefill_tokens,
            self._pool.num_used,
        )

    @property
    def num_preemptions(self) -> int:
        return self._scheduler.num_preemptions

    def cached_block_hashes(self) -> set[int]:
        """Hashes in the prefix cache now; what folding every step's ``kv_changes`` gives."""
        return self._pool.cached_hashes()
