"""``TorchEngine``: the protocol's engine, computing a real model over a paged, prefix-cached KV
cache.

Scheduling and block accounting are ``sim``'s, reused as they are, so this engine batches,
chunks, preempts and caches exactly as ``sim`` does; each step then runs the model on the
scheduled tokens and samples a token for every request that reached the end of its sequence.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.protocol import EngineCapabilities, EngineRequest, StepResult
from services.engine.scheduling.config import SimConfig
from services.engine.scheduling.request import SimRequest
from services.engine.scheduling.scheduled import ScheduledEngine
from services.engine.torch_engine.blocks import PagedBlockPool, PagedKvManager
from services.engine.torch_engine.config import TorchEngineConfig
from services.engine.torch_engine.export import (
    KvExport,
    export_blocks,
    from_bytes,
    import_blocks,
    to_bytes,
)
from services.engine.torch_engine.host_tier import HostKvStore
from services.engine.torch_engine.kv_cache import PagedKvCache, SeqChunk, paged_forward
from services.engine.torch_engine.model import DTYPES, LlamaForCausalLM, load_model
from services.engine.torch_engine.sampler import RequestSampler, sample

_SEED_MASK = (1 << 64) - 1


@dataclass(slots=True, eq=False)
class _Sampling:
    sampler: RequestSampler
    # The request's stop tokens, and end-of-sequence unless it ignores it.
    stop_token_ids: frozenset[int]


class TorchEngine(ScheduledEngine):
    engine_kind = "torch"

    def __init__(self, model_dir: Path, config: TorchEngineConfig | None = None) -> None:
        config = config or TorchEngineConfig()
        device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        self.model: LlamaForCausalLM = load_model(model_dir, device, dtype)
        self._seed = config.seed
        self._device = device
        scheduling = SimConfig(
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self._cache = PagedKvCache(
            self.model.config, config.num_gpu_blocks, config.block_size, device, dtype
        )
        self.capabilities = EngineCapabilities(
            kv_handoff=True,
            kv_events=True,
            modelled_time=False,
            kv_bytes_per_token=self._cache.bytes_per_token,
        )
        host = HostKvStore(self._cache, config.num_host_blocks) if config.num_host_blocks else None
        pool = PagedBlockPool(config.num_gpu_blocks, host)
        self._paged_pool = pool
        self._paged_kv = PagedKvManager(pool, config.block_size)
        super().__init__(scheduling, pool, self._paged_kv)
        self.max_model_len = min(self.max_model_len, self.model.config.max_position_embeddings)
        self._eos = frozenset(self.model.config.eos_token_ids)
        self._sampling: dict[str, _Sampling] = {}

    def add_request(self, request: EngineRequest) -> None:
        req = self._new_request(request)
        sampling = request.sampling
        seed = sampling.seed
        if seed is None:
            # crc32, not hash(): str hashes change with every interpreter run.
            seed = zlib.crc32(request.request_id.encode(), self._seed)
        stops = req.stop_token_ids if sampling.ignore_eos else req.stop_token_ids | self._eos
        sampler = RequestSampler.create(sampling, seed & _SEED_MASK)
        self._sampling[req.request_id] = _Sampling(sampler, stops)
        self._admit(req)

    def _forget(self, request_id: str) -> None:
        del self._sampling[request_id]

    def _stop_token_ids(self, req: SimRequest) -> frozenset[int]:
        return self._sampling[req.request_id].stop_token_ids

    def _check(self, req: SimRequest) -> None:
        config = self.model.config
        prompt = req.prompt
        if min(prompt) < 0 or max(prompt) >= config.vocab_size:
            raise ValueError(f"request {req.request_id} has token ids outside the vocabulary")
        positions = len(prompt) + req.max_tokens - 1
        if positions > config.max_position_embeddings:
            raise ValueError(
                f"request {req.request_id} needs {positions} positions, "
                f"the model has {config.max_position_embeddings}"
            )

    def step(self) -> StepResult:
        start = time.perf_counter()
        batch = self._scheduler.schedule()
        if not batch.scheduled:
            return StepResult(kv_changes=self._pool.drain_changes())
        tokens = iter(self._compute(batch.scheduled))
        outputs = self._advance(batch, lambda req: next(tokens))
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
        kv = self._paged_kv
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
                samplers.append(self._sampling[req.request_id].sampler)
        hidden = paged_forward(self.model, self._cache, chunks)
        if not rows:
            return []
        return sample(self.model.compute_logits(hidden[rows]), samplers)

    def import_kv(self, export: KvExport) -> int:
        """Cache another engine's exported blocks so requests with that prefix hit them; how many
        blocks were copied in. The ``BlocksStored`` changes come with the next step's result."""
        return import_blocks(self._cache, self._paged_pool, export)

    def export_prefix(self, block_hashes: Sequence[int]) -> tuple[int, bytes]:
        """The leading blocks held here, on the device and then in the host tier (a KV move
        may pull either), and their K and V."""
        pool = self._paged_pool
        hits, _ = pool.count_hits(block_hashes, len(block_hashes))
        hashes = list(block_hashes[:hits])
        export = export_blocks(self._cache, hashes, [pool.block_id(h) for h in hashes])
        held = hits + pool.count_host(block_hashes, hits, len(block_hashes))
        if held > hits:
            assert pool.host is not None  # only a host tier holds blocks beyond the hits
            key, value = pool.host.read(block_hashes[hits:held])
            export = KvExport(
                export.layout,
                tuple(block_hashes[:held]),
                torch.cat([export.key, key], 1),
                torch.cat([export.value, value], 1),
            )
        return held, to_bytes(export)

    def import_prefix(self, block_hashes: Sequence[int], payload: bytes) -> int:
        export = from_bytes(payload)
        if export.block_hashes != tuple(block_hashes[: len(export.block_hashes)]):
            raise ValueError("the KV payload is not a prefix of the request's blocks")
        self.import_kv(export)
        return self._paged_pool.count_hits(block_hashes, len(block_hashes))[0]


def _tokens(req: SimRequest, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of the request's prompt followed by its output so far."""
    prompt = req.prompt
    split = len(prompt)
    if end <= split:
        return list(prompt[start:end])
    return [*prompt[start:], *req.output[max(start - split, 0) : end - split]]
