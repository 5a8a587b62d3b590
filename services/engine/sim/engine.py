"""``SimEngine``: the protocol's engine with real KV accounting and modelled step times."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.common.kv_transfer import KvTransferModel
from services.common.perf_model import PerfModel, perf_model
from services.engine.protocol import (
    EngineCapabilities,
    EngineRequest,
    RequestOutput,
    StepResult,
)
from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.config import SimConfig
from services.engine.scheduling.decode_run import DecodeRun
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.scheduled import ScheduledEngine


class SimEngine(ScheduledEngine):
    """Schedules like vLLM v1 over a paged, prefix-cached KV pool and reports how long each step
    would take. ``perf`` overrides the perf model named in ``config``."""

    engine_kind = "sim"

    def __init__(self, config: SimConfig, perf: PerfModel | None = None) -> None:
        pool = BlockPool(config.num_gpu_blocks, config.num_host_blocks)
        super().__init__(config, pool, KvCacheManager(pool, config.block_size))
        self._perf = perf if perf is not None else perf_model(config.perf_model)
        self._host_link = KvTransferModel(
            config.kv_bytes_per_token, config.host_link_gb_s, config.host_link_latency_ms
        )
        # Requests whose KV another worker sends: the transfer's ms, paid when first scheduled.
        self._transfers_ms: dict[str, float] = {}
        # Requests of a LoRA adapter not yet scheduled (the adapter loads then, if it is not
        # resident), and the adapters resident, least recently used first.
        self._lora_of: dict[str, str] = {}
        self._loras: OrderedDict[str, None] = OrderedDict()
        self._max_loras, self._lora_load_ms = config.max_loras, config.lora_load_ms
        self.capabilities = EngineCapabilities(
            kv_handoff=True,
            kv_events=True,
            modelled_time=True,
            whole_prompt_handoff=True,
            decode_runs=True,
            max_loras=config.max_loras,
        )
        # The adapter loads so far.
        self.lora_loads = 0

    def add_request(self, request: EngineRequest) -> None:
        try:
            self._admit(self._new_request(request))
        except ValueError:
            if request.request_id not in self._requests:
                self._transfers_ms.pop(request.request_id, None)  # expected, never queued
            raise
        if request.lora is not None:
            self._lora_of[request.request_id] = request.lora

    def expect_transfer(self, request_id: str, transfer_ms: float) -> None:
        """The request added next under ``request_id`` is a live KV move's, its blocks imported
        just before: it queues at once and the step that first schedules it waits out the
        transfer, as :meth:`add_moved` has it offline."""
        self._transfers_ms[request_id] = transfer_ms

    def add_handed_off(self, request: EngineRequest, prompt_tokens: int) -> None:
        """A request whose first ``prompt_tokens`` tokens a prefill worker computed and whose KV
        it handed over with them (the full blocks through :meth:`import_blocks` first); the rest
        of ``request``'s prompt is the first token, which the next decode step consumes."""
        req = self._new_request(request)
        if not 0 < prompt_tokens < len(req.prompt):
            raise ValueError(f"{prompt_tokens} handed-off tokens of a {len(req.prompt)} prompt")
        req.prefill_len = prompt_tokens
        req.handed_off = True
        self._admit(req)

    def add_moved(self, request: EngineRequest, blocks: int, transfer_ms: float) -> None:
        """A request whose prompt's first ``blocks`` blocks another worker sends (a KV move): it
        queues now, in arrival order, and the step that first schedules it waits out the
        transfer, as a synchronous KV load does."""
        self.add_request(request)
        self.import_blocks(self._requests[request.request_id].hashes[:blocks])
        self._transfers_ms[request.request_id] = transfer_ms

    def _forget(self, request_id: str) -> None:
        self._transfers_ms.pop(request_id, None)
        self._lora_of.pop(request_id, None)

    def _load_loras(self, request_ids: Sequence[str]) -> float:
        """The adapters of the requests a step schedules first made resident; the ms their loads
        take (vLLM loads an adapter before the step that runs it)."""
        load_ms = 0.0
        loras = self._loras
        for request_id in request_ids:
            lora = self._lora_of.pop(request_id, None)
            if lora is None:
                continue
            if lora in loras:
                loras.move_to_end(lora)
                continue
            load_ms += self._lora_load_ms
            self.lora_loads += 1
            loras[lora] = None
            if len(loras) > self._max_loras:
                loras.popitem(last=False)
        self.held_loras = tuple(loras)
        return load_ms

    @property
    def coming_loras(self) -> tuple[str, ...]:
        """The adapters of the requests queued and not yet run, in their order."""
        return tuple(self._lora_of.values())

    def import_blocks(self, block_hashes: Sequence[int]) -> int:
        """Take a prompt's KV blocks handed over by a prefill worker into the prefix cache (as
        if computed here); how many leading blocks are cached afterwards."""
        return self._pool.import_cached(None, block_hashes)

    def cached_prefix(self, block_hashes: Sequence[int]) -> tuple[int, int]:
        """How many leading blocks of ``block_hashes`` are cached here (and how many idle)."""
        return self._pool.count_hits(block_hashes, len(block_hashes))

    def held_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``block_hashes`` this worker could send, GPU or host tier."""
        gpu = self.cached_prefix(block_hashes)[0]
        return gpu + self._pool.count_host(block_hashes, gpu, len(block_hashes))

    def export_prefix(self, block_hashes: Sequence[int]) -> tuple[int, bytes]:
        # Modelled KV has no contents to send: the receiver models the transfer's time. A KV
        # move may take blocks from the host tier too.
        return self.held_prefix(block_hashes), b""

    def import_prefix(self, block_hashes: Sequence[int], payload: bytes) -> int:
        return self.import_blocks(block_hashes)

    def decode_run(self, start: float, until: float) -> DecodeRun | None:
        """Every decode step from ``start`` (seconds) that begins before ``until``, at once, when
        they are plain decode steps (see :func:`~services.engine.scheduling.decode_run.decode_run`):
        for a simulation, which needs no per-step outputs. None when the next step is not one."""
        if self._transfers_ms or self._lora_of:
            return None
        perf, total = self._perf, self.kv_blocks_total
        return self._decode_run(
            lambda n, used: perf.step_ms(0, n, used / total) / 1000.0, start, until
        )

    def run_steps(self, until_s: float) -> StepResult | None:
        run = self.decode_run(0.0, until_s)
        if run is None:
            return None
        steps = len(run.times) - 1
        ended = {req.request_id for req in run.finished}
        outputs = [
            RequestOutput(
                req.request_id,
                tuple(req.output[-steps:]),
                req.request_id in ended,
                "length" if req.request_id in ended else None,
            )
            for req in run.requests
        ]
        return StepResult(
            outputs=outputs,
            kv_changes=[*run.ended_changes, *run.last_changes],
            duration_s=run.times[-1],
            step_ends_s=tuple(run.times[1:]),
        )

    def step(self) -> StepResult:
        batch = self._scheduler.schedule()
        if not batch.scheduled:
            return StepResult(kv_changes=self._pool.drain_changes())
        # Adapters load before the step runs (and before a request it ends is forgotten).
        lora_ms = (
            self._load_loras([r.request_id for r, _ in batch.scheduled]) if self._lora_of else 0.0
        )
        # The KV the step's attention reads: every running request's blocks, this step's included.
        kv_usage = self._pool.num_used / self.kv_blocks_total
        outputs = self._advance(batch, lambda req: req.words.next_token())
        step_ms = self._perf.step_ms(batch.prefill_tokens, batch.decode_seqs, kv_usage) + lora_ms
        # Loads from host memory, and moved KV, arrive before the step's attention reads them.
        step_ms += self._host_link.transfer_ms(batch.loaded_tokens)
        if self._transfers_ms:
            moves = self._transfers_ms
            step_ms += max((moves.pop(r.request_id, 0.0) for r, _ in batch.scheduled), default=0.0)
        return StepResult(
            outputs=outputs,
            kv_changes=self._pool.drain_changes(),
            duration_s=step_ms / 1000.0,
            prefill_tokens=batch.prefill_tokens,
        )
