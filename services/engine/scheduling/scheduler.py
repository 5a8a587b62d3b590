"""Continuous batching as vLLM v1 schedules it: running requests first, then waiting ones FIFO,
under a token budget per step, chunked prefill, and preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.scheduling.config import SimConfig
from services.engine.scheduling.kv_manager import KvCacheManager
from services.engine.scheduling.request import SimRequest


@dataclass(slots=True)
class Batch:
    """One step's work: how many new tokens to compute for which request."""

    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    # Prompt tokens whose KV admission loads from host memory instead of computing.
    loaded_tokens: int = 0


class Scheduler:
    def __init__(self, config: SimConfig, kv: KvCacheManager) -> None:
        self._max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._kv = kv
        # In admission order, so the back is the most recently admitted: the preemption victim.
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        # Tokens still to prefill, of waiting and partly prefilled requests.
        self.pending_prefill_tokens = 0
        self.num_preemptions = 0

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.pending_prefill_tokens += self._pending_prefill(req)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        running = self.running
        preemptions_before = self.num_preemptions

        kv = self._kv
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            if not kv.grow(req, num_new) and not self._preempt_until_fits(req, num_new):
                break
            self._add_to_batch(batch, req, num_new)
            budget -= num_new
            i += 1

        # Like vLLM, admit nobody in a step that had to preempt: the KV cache is full.
        if self.num_preemptions != preemptions_before:
            return batch

        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self._max_num_seqs:
            req = waiting[0]
            hits, idle_hits = kv.prefix_hits(req)
            loaded = 0 if req.handed_off else kv.host_hits(req, hits)
            cached = (hits + loaded) * kv.block_size
            # A hand-off carried its partial last block's KV too, usable while its full blocks
            # are still cached; otherwise it prefills what is missing like any request.
            whole = req.handed_off and hits == req.prefill_len // kv.block_size
            if whole:
                cached = req.prefill_len
            num_new = min(req.num_tokens - cached, budget)
            if not kv.admit(req, hits, idle_hits, cached - hits * kv.block_size + num_new):
                break
            # Loaded blocks count computed: cached like computed ones after the step.
            batch.loaded_tokens += loaded * kv.block_size
            req.num_computed = cached
            if req.handed_off:
                self._settle_hand_off(req, whole)
            waiting.popleft()
            running.append(req)
            req.running = True
            if req.cached_tokens is None:
                req.cached_tokens = cached
            self.pending_prefill_tokens -= cached
            self._add_to_batch(batch, req, num_new)
            budget -= num_new
        return batch

    def _settle_hand_off(self, req: SimRequest, whole: bool) -> None:
        """A waiting hand-off counts no prompt to prefill; admitted, it owes what any request
        would, which is nothing when its KV came whole."""
        req.handed_off = False  # once: a preempted request recomputes everything
        if not whole:
            req.prefill_len = req.num_tokens
        self.pending_prefill_tokens += req.prefill_len

    def _add_to_batch(self, batch: Batch, req: SimRequest, num_new: int) -> None:
        batch.scheduled.append((req, num_new))
        if req.num_computed < req.prefill_len:
            batch.prefill_tokens += num_new
            self.pending_prefill_tokens -= num_new
        else:
            batch.decode_seqs += 1

    def _preempt_until_fits(self, req: SimRequest, num_new: int) -> bool:
        """Preempt from the back of the running list until a running request's next tokens fit;
        False if the request itself had to go."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
            if self._kv.grow(req, num_new):
                return True

    def _preempt(self, req: SimRequest) -> None:
        self._kv.free(req)
        self.pending_prefill_tokens -= self._pending_prefill(req)
        # Everything computed so far, generated tokens included, is computed again on return.
        req.num_computed = 0
        req.prefill_len = req.num_tokens
        req.running = False
        self.pending_prefill_tokens += req.prefill_len
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, finished: list[SimRequest]) -> None:
        for req in finished:
            self._kv.free(req)
            req.running = False
        gone = set(finished)
        self.running = [r for r in self.running if r not in gone]

    def abort(self, req: SimRequest) -> None:
        self.pending_prefill_tokens -= self._pending_prefill(req)
        if req.running:
            self.running.remove(req)
            self._kv.free(req)
            req.running = False
        else:
            self.waiting.remove(req)

    @staticmethod
    def _pending_prefill(req: SimRequest) -> int:
        if req.handed_off:
            return 0
        return max(0, req.prefill_len - req.num_computed)
