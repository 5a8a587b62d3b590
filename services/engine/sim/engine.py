"""``SimEngine``: the protocol's engine with real KV accounting and modelled step times."""

from __future__ import annotations

from services.engine.protocol import EngineLoad, EngineRequest, RequestOutput, StepResult
from services.engine.sim.block_pool import BlockPool
from services.engine.sim.config import SimConfig
from services.engine.sim.kv_manager import KvCacheManager
from services.engine.sim.request import SimRequest
from services.engine.sim.scheduler import Scheduler
from services.engine.sim.timing import TimingModel, timing_preset


class SimEngine:
    """Schedules like vLLM v1 over a paged, prefix-cached KV pool and reports how long each step
    would take. ``timing`` overrides the preset named in ``config``."""

    def __init__(self, config: SimConfig, timing: TimingModel | None = None) -> None:
        self.block_size = config.block_size
        self.kv_blocks_total = config.num_gpu_blocks
        self.max_num_seqs = config.max_num_seqs
        self._timing = timing if timing is not None else timing_preset(config.timing)
        self._pool = BlockPool(config.num_gpu_blocks)
        self._kv = KvCacheManager(self._pool, config.block_size)
        self._scheduler = Scheduler(config, self._kv)
        self._requests: dict[str, SimRequest] = {}

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already in the engine")
        req = SimRequest.from_engine_request(request, self.block_size)
        # The KV of every token but the last sampled one; a request that can never fit would be
        # preempted and readmitted forever.
        needed_blocks = -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)
        if needed_blocks > self.kv_blocks_total:
            raise ValueError(
                f"request {request.request_id} needs {needed_blocks} KV blocks, "
                f"the engine has {self.kv_blocks_total}"
            )
        self._requests[req.request_id] = req
        self._scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._scheduler.abort(req)
        return True

    def step(self) -> StepResult:
        batch = self._scheduler.schedule()
        if not batch.scheduled:
            return StepResult(kv_changes=self._pool.drain_changes())
        # The KV the step's attention reads: every running request's blocks, this step's included.
        kv_usage = self._pool.num_used / self.kv_blocks_total
        kv = self._kv
        outputs: list[RequestOutput] = []
        finished: list[SimRequest] = []
        for req, num_new in batch.scheduled:
            req.num_computed += num_new
            kv.cache_computed(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that does not reach the end of the prompt
            out = self._sample(req)
            outputs.append(out)
            if out.finished:
                finished.append(req)
        if finished:
            self._scheduler.finish(finished)
            for req in finished:
                del self._requests[req.request_id]
        step_ms = self._timing.step_ms(batch.prefill_tokens, batch.decode_seqs, kv_usage)
        return StepResult(
            outputs=outputs,
            kv_changes=self._pool.drain_changes(),
            duration_s=step_ms / 1000.0,
            prefill_tokens=batch.prefill_tokens,
        )

    def _sample(self, req: SimRequest) -> RequestOutput:
        token = req.words.next_token()
        req.append_token(token)
        # Only one output can carry the first token, preempted or not.
        cached_tokens = req.cached_tokens if len(req.output) == 1 else None
        # Length before stop, as vLLM checks them.
        if len(req.output) >= req.max_tokens:
            return RequestOutput(req.request_id, (token,), True, "length", cached_tokens)
        if token in req.stop_token_ids:
            return RequestOutput(req.request_id, (token,), True, "stop", cached_tokens)
        return RequestOutput(req.request_id, (token,), cached_tokens=cached_tokens)

    def has_work(self) -> bool:
        return bool(self._requests)

    def load(self) -> EngineLoad:
        scheduler = self._scheduler
        return EngineLoad(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            waiting_prefill_tokens=scheduler.pending_prefill_tokens,
            kv_blocks_used=self._pool.num_used,
            kv_blocks_total=self.kv_blocks_total,
        )

    @property
    def num_preemptions(self) -> int:
        return self._scheduler.num_preemptions

    def cached_block_hashes(self) -> set[int]:
        """Hashes in the prefix cache now; what folding every step's ``kv_changes`` gives."""
        return self._pool.cached_hashes()
