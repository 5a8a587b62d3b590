"""One simulated worker of an offline replay: its engine, role, place and bookkeeping, and the
view of it the planner's decision gets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infra.bench.metrics import WorkerRecord
from schemas.events import Role
from services.common.kv_index.index import PrefixIndex
from services.engine.sim import SimEngine
from services.planner.adapters import adapters_ahead
from services.planner.policy import WorkerView


@dataclass
class SimWorker:
    worker_id: str
    engine: SimEngine
    record: WorkerRecord
    role: Role = "both"
    # The node it runs on ('': no topology).
    node: str = ""
    # The role it moves to once its in-flight work is done (the capacity loop moved it).
    next_role: Role | None = None
    # Requests its engine holds (a prefill worker's included): it switches roles at none.
    in_flight: int = 0
    # Requests routed to it to decode that have not ended, its KV wait included: what the live
    # planner counts in flight there.
    routed: int = 0
    stepping: bool = False
    # While stepping and catching up on its own: when its step (or decode run's last step) ends,
    # and the step's result or the run with its batch's records.
    end: float = 0.0
    pending: Any = None
    kv_seq: int = 0
    # Since when it has served in `role`, and its busy seconds since.
    role_since: float = 0.0
    busy_in_role: float = 0.0
    # The model it serves (model pools); None: the one model of the replay.
    model: str | None = None

    def view(
        self, overlaps: dict[str, int], index: PrefixIndex, hashes: Sequence[int] = ()
    ) -> WorkerView:
        """What the planner knows of it for a prompt of ``hashes`` (``overlaps``: the index's
        answer for them); the host tier is looked up only when ``hashes`` are given."""
        engine = self.engine
        running, waiting, waiting_prefill_tokens, used = engine.load_counts()
        cached = overlaps.get(self.worker_id, 0)
        loras, loads_ahead = adapters_ahead(
            engine.held_loras, engine.coming_loras, engine.capabilities.max_loras
        )
        return WorkerView(
            worker_id=self.worker_id,
            running=running,
            waiting=waiting,
            kv_usage=used / engine.kv_blocks_total,
            in_flight=self.routed,
            cached_blocks=cached,
            waiting_prefill_tokens=waiting_prefill_tokens,
            block_size=engine.block_size,
            kv_capacity_tokens=engine.kv_blocks_total * engine.block_size,
            host_blocks=index.host_run(self.worker_id, hashes, cached) if hashes else 0,
            node=self.node,
            loras=loras,
            lora_loads_ahead=loads_ahead,
        )
