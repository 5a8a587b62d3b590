"""``TorchEngine``: the protocol's engine, computing a real model over a paged, prefix-cached KV
cache.

Scheduling and block accounting are ``sim``'s, reused as they are, so this engine batches,
chunks, preempts and caches exactly as ``sim`` does; each step then runs the model on the
scheduled tokens and samples a token for every request that reached the end of its sequence.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.protocol import EngineLoad, EngineRequest, RequestOutput, StepResult
from services.engine.sim.config import SimConfig
from services.engine.sim.request import SimRequest
from services.engine.sim.scheduler import Scheduler
from services.engine.torch_engine.blocks import PagedBlockPool, PagedKvManager
from services.engine.torch_engine.config import TorchEngineConfig
from services.engine.torch_engine.export import KvExport, export_blocks, import_blocks
from services.engine.torch_engine.kv_cache import PagedKvCache, SeqChunk, paged_forward
from services.engine.torch_engine.model import DTYPES, LlamaForCausalLM, load_model
from services.engine.torch_engine.sampler import RequestSampler, sample

_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True, eq=False)
class _Live:
    req: SimRequest
    sampler: RequestSampler
    # The request's stop tokens, and end-of-sequence unless it ignores it.
    stop_token_ids: frozenset[int]


class TorchEngine:
    def __init__(self, model_dir: Path, config: TorchEngineConfig | None = None) -> None:
        config = config or TorchEngineConfig()
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        self.model: LlamaForCausalLM = load_model(model_dir, device, dtype)
        self.block_size = config.block_size
        self.kv_blocks_total = config.num_gpu_blocks
        self.max_num_seqs = config.max_num_seqs
        self._seed = config.seed
        self._device = device
        self._pool = PagedBlockPool(config.num_gpu_blocks)
        self._kv = PagedKvManager(self._pool, config.block_size)
        scheduling = SimConfig(
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self._scheduler = Scheduler(scheduling, self._kv)
        self._cache = PagedKvCache(
            self.model.config, config.num_gpu_blocks, config.block_size, device, dtype
        )
        self._eos = frozenset(self.model.config.eos_token_ids)
        self._requests: dict[str, _Live] = {}

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id} is already in the engine")
        req = SimRequest.from_engine_request(request, self.block_size)
        self._check_fits(req)
        sampling = request.sampling
        seed = sampling.seed
        if seed is None:
            # crc32, not hash(): str hashes change with every interpreter run.
            seed = zlib.crc32(request.request_id.encode(), self._seed)
        stops = req.stop_token_ids if sampling.ignore_eos else req.stop_token_ids | self._eos
        sampler = RequestSampler.create(sampling, seed & _SEED_MASK)
        self._requests[req.request_id] = _Live(req, sampler, stops)
        self._scheduler.add(req)

    def _check_fits(self, req: SimRequest) -> None:
        config = self.model.config
        prompt = req.prompt
        if min(prompt) < 0 or max(prompt) >= config.vocab_size:
            raise ValueError(f"request {req.request_id} has token ids outside the vocabulary")
        # The KV of every token but the last sampled one; a request that can never fit would be
        # preempted and readmitted forever.
        positions = len(prompt) + req.max_tokens - 1
        if positions > config.max_position_embeddings:
            raise ValueError(
                f"request {req.request_id} needs {positions} positions, "
                f"the model has {config.max_position_embeddings}"
            )
        needed_blocks = -(-positions // self.block_size)
        if needed_blocks > self.kv_blocks_total:
            raise ValueError(
                f"request {req.request_id} needs {needed_blocks} KV blocks, "
                f"the engine has {self.kv_blocks_total}"
            )

    def abort(self, request_id: str) -> bool:
        live = self._requests.pop(request_id, None)
        if live is None:
            return False
        self._scheduler.abort(live.req)
        return True

    def step(self) -> StepResult:
        start = time.perf_counter()
        batch = self._scheduler.schedule()
        if not batch.scheduled:
            return StepResult(kv_changes=self._pool.drain_changes())
        tokens = iter(self._compute(batch.scheduled))
        kv = self._kv
        outputs: list[RequestOutput] = []
        finished: list[SimRequest] = []
        for req, num_new in batch.scheduled:
            req.num_computed += num_new
            kv.cache_computed(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that does not reach the end of the prompt
            out = self._emit(self._requests[req.request_id], next(tokens))
            outputs.append(out)
            if out.finished:
                finished.append(req)
        if finished:
            self._scheduler.finish(finished)
            for req in finished:
                del self._requests[req.request_id]
        if self._device.type == "cuda":
            # Steps that sample nothing never wait for the device; the duration must include it.
            torch.cuda.synchronize(self._device)
        return StepResult(
            outputs=outputs,
            kv_changes=self._pool.drain_changes(),
            duration_s=time.perf_counter() - start,
            prefill_tokens=batch.prefill_tokens,
        )

    @torch.inference_mode()
    def _compute(self, scheduled: list[tuple[SimRequest, int]]) -> list[int]:
        """Run the model on the step's tokens; the next token of each request, in batch order,
        that this step brings to the end of its sequence."""
        kv = self._kv
        chunks = []
        rows: list[int] = []
        samplers: list[RequestSampler] = []
        end = 0
        for req, num_new in scheduled:
            start = req.num_computed
            chunks.append(SeqChunk(_tokens(req, start, start + num_new), start, kv.block_ids(req)))
            end += num_new
            if start + num_new == req.num_tokens:
                rows.append(end - 1)
                samplers.append(self._requests[req.request_id].sampler)
        hidden = paged_forward(self.model, self._cache, chunks)
        if not rows:
            return []
        return sample(self.model.compute_logits(hidden[rows]), samplers)

    def _emit(self, live: _Live, token: int) -> RequestOutput:
        req = live.req
        req.append_token(token)
        # Only one output can carry the first token, preempted or not.
        cached_tokens = req.cached_tokens if len(req.output) == 1 else None
        # Length before stop, as vLLM checks them.
        if len(req.output) >= req.max_tokens:
            return RequestOutput(req.request_id, (token,), True, "length", cached_tokens)
        if token in live.stop_token_ids:
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

    def export_kv(self, request_id: str) -> KvExport:
        """The KV of a running request's full, computed blocks, e.g. after its prefill step."""
        live = self._requests.get(request_id)
        if live is None or not live.req.running:
            raise ValueError(f"request {request_id} is not running in this engine")
        req = live.req
        full = req.num_computed // self.block_size
        hashes = req.hashes_upto(full, self.block_size)[:full]
        return export_blocks(self._cache, hashes, self._kv.block_ids(req)[:full])

    def import_kv(self, export: KvExport) -> int:
        """Cache another engine's exported blocks so requests with that prefix hit them; how many
        blocks were copied in. The ``BlocksStored`` changes come with the next step's result."""
        return import_blocks(self._cache, self._pool, export)


def _tokens(req: SimRequest, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of the request's prompt followed by its output so far."""
    prompt = req.prompt
    split = len(prompt)
    if end <= split:
        return list(prompt[start:end])
    return [*prompt[start:], *req.output[max(start - split, 0) : end - split]]
