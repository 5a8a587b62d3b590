"""Laneway's KV connector for vLLM: how a hand-off's KV blocks get into vLLM's paged KV cache, and
through which vLLM then caches them as its own.

A decode worker's engine stages the blocks another engine exported (``VllmEngine.import_prefix``)
in a :class:`KvStage`; then vLLM's scheduler asks its connector how many tokens beyond its own
prefix cache hit can be loaded (``get_num_new_matched_tokens``: the staged full blocks that
follow the hit in the request's chain of Laneway block hashes), allocates blocks for them, and
the connector's worker half copies the staged KV into those blocks before the step's forward
(``start_load_kv``). vLLM counts the loaded tokens as cached, computes only the rest, and caches
the loaded blocks like computed ones, so its KV events announce them with that step.

Everything runs in the worker's process (vLLM's engine core in-process, ``UniProcExecutor``):
the stage is shared by reference, found by the scheduler half through an id in
``kv_connector_extra_config`` and carried to the worker half in the step's metadata. That
matters because vLLM keeps one worker-side connector per process, made by the first engine
there, while each engine's scheduler has a connector of its own.

Importing this module imports vLLM: the engine imports it once vLLM is set up.
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from schemas.block_hash import chain_block_hashes
from services.engine.kv_payload import pack, unpack
from services.engine.vllm_engine.engine import _root_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONNECTOR = "LanewayConnector"
# The key of the engine's stage id in ``kv_connector_extra_config``.
STAGE_ID = "laneway_stage"

# Each engine's stage by id; weak, so that a closed engine's goes with it.
_stages: weakref.WeakValueDictionary[str, KvStage] = weakref.WeakValueDictionary()


class KvStage:
    """One engine's KV cache (its layers' tensors, blocks first) and the hand-off blocks staged
    for it, by Laneway block hash. Used by the engine and both halves of its connector, all on
    the engine's one thread. Staged blocks go when loaded, when a request they belong to ends
    or is aborted, and, oldest first, when more than ``capacity`` blocks wait."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self._capacity = 0
        # Laneway block hash -> that block's KV, every layer's: [layers, *block].
        self._staged: OrderedDict[int, Tensor] = OrderedDict()
        # Each layer's paged KV cache, as vLLM's attention reads it: [blocks, *block].
        self._layers: list[Tensor] = []
        _stages[self.id] = self

    @classmethod
    def of(cls, stage_id: str) -> KvStage:
        return _stages[stage_id]

    def attach(self, layers: Sequence[Tensor], capacity: int) -> None:
        """The KV cache's tensors, one a layer, in the model's layer order; staging holds at
        most ``capacity`` blocks."""
        self._layers = list(layers)
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._staged)

    # -- out of the cache and in: a hand-off's bytes ------------------------------------------

    def export(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> bytes:
        """Blocks ``block_ids`` of the cache, named ``block_hashes``, as a hand-off payload."""
        if not block_ids:
            return pack((), {})
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._layers[0].device)
        kv = torch.stack([layer.index_select(0, index) for layer in self._layers], dim=1)
        return pack(block_hashes, {"kv": kv.cpu()})

    def stage(self, data: bytes, block_hashes: Sequence[int]) -> int:
        """Keep a payload's blocks, the leading ``block_hashes``, for loading; how many.
        ValueError if they are not those blocks or do not fit this cache (another model, block
        size or dtype)."""
        hashes, tensors = unpack(data)
        if hashes != tuple(block_hashes[: len(hashes)]):
            raise ValueError("the KV payload is not a prefix of the request's blocks")
        if not hashes:
            return 0
        kv = tensors.get("kv")
        shape = (len(hashes), len(self._layers), *self._layers[0].shape[1:])
        dtype = self._layers[0].dtype
        if kv is None or tuple(kv.shape) != shape or kv.dtype != dtype:
            got = None if kv is None else (tuple(kv.shape), kv.dtype)
            raise ValueError(f"KV payload {got} does not fit this cache's {(shape, dtype)}")
        for i, block_hash in enumerate(hashes):
            self._staged.pop(block_hash, None)
            # A copy: a view would hold the whole payload for as long as any one block waits.
            self._staged[block_hash] = kv[i].clone()
        while len(self._staged) > self._capacity:
            self._staged.popitem(last=False)
        return len(hashes)

    # -- the connector's side ---------------------------------------------------------------

    def run(self, block_hashes: Sequence[int], start: int) -> int:
        """How many of ``block_hashes`` from ``start`` on are staged, one after another."""
        n = start
        while n < len(block_hashes) and block_hashes[n] in self._staged:
            n += 1
        return n - start

    def drop(self, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            self._staged.pop(block_hash, None)

    def clear(self) -> None:
        self._staged.clear()

    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Copy the staged blocks into the cache's ``block_ids`` and forget them; the blocks
        whose KV is gone (vLLM recomputes them)."""
        taken = [
            (i, self._staged.pop(h, None)) for i, h in zip(block_ids, block_hashes, strict=True)
        ]
        present = [(i, kv) for i, kv in taken if kv is not None]
        failed = [i for i, kv in taken if kv is None]
        if not present:
            return failed
        device = self._layers[0].device
        index = torch.tensor([i for i, _ in present], dtype=torch.int64, device=device)
        kv = torch.stack([kv for _, kv in present], dim=1).to(device)
        for layer, blocks in zip(self._layers, kv, strict=True):
            layer.index_copy_(0, index, blocks)
        return failed


def request_hashes(request: Request, block_size: int) -> tuple[int, ...]:
    """Laneway's chained hashes of the request's full blocks that may come from elsewhere: all
    but the block of its last token, which vLLM always computes."""
    full = (request.num_tokens - 1) // block_size
    tokens = list(request.all_token_ids[: full * block_size])
    root = _root_of((request.cache_salt,)) if request.cache_salt else _root_of(())
    return chain_block_hashes(tokens, block_size, root)


@dataclass
class _Load:
    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class LanewayConnectorMetadata(KVConnectorMetadata):
    """One step's loads, with the stage (and the cache) they come from and go to."""

    stage: KvStage | None = None
    loads: list[_Load] = field(default_factory=list)


class LanewayConnector(KVConnectorBase_V1):
    """``kv_role`` "kv_both": every engine may take a hand-off; exports read the cache directly
    (``VllmEngine.export_prefix``), so nothing is saved while a step runs."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._stage: KvStage | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._stage = KvStage.of(self._kv_transfer_config.kv_connector_extra_config[STAGE_ID])
        # Request id -> (first block to load, the hashes from there), as last matched.
        self._matched: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._loads: list[_Load] = []
        # Worker half: the blocks this step's loads could not fill.
        self._failed: set[int] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # Nothing is sent from a running request: a preempted one has nothing pending.
        return False

    # -- scheduler half ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        stage = self._stage
        assert stage is not None
        if not len(stage):
            return 0, False  # the usual case, aggregated serving: nothing hashed
        hashes = request_hashes(request, self._block_size)
        start = num_computed_tokens // self._block_size
        n = stage.run(hashes, start)
        # Remembered for update_state_after_alloc; matching again overwrites it.
        self._matched[request.request_id] = (start, hashes[start : start + n])
        return n * self._block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        stage = self._stage
        assert stage is not None
        start, hashes = matched
        # What vLLM found in its own cache needs no staged copy.
        stage.drop(request_hashes(request, self._block_size)[:start])
        n = num_external_tokens // self._block_size
        if n:
            block_ids = blocks.get_block_ids()[0][start : start + n]
            self._loads.append(_Load(hashes[:n], tuple(block_ids)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LanewayConnectorMetadata(self._stage, self._loads)
        self._loads = []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        stage = self._stage
        if stage is not None and len(stage):
            # Blocks staged for this request and never loaded (it was aborted while waiting,
            # or vLLM held them already) are of no more use.
            stage.drop(request_hashes(request, self._block_size))
        return False, None

    def reset_cache(self) -> bool:
        """vLLM's prefix cache reset with its connector's: the staged blocks go too."""
        if self._stage is not None:
            self._stage.clear()
        return True

    # -- worker half ------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LanewayConnectorMetadata)
        if meta.stage is None:
            return
        for load in meta.loads:
            self._failed.update(meta.stage.load(load.block_hashes, load.block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Asked after this step's loads, before the next step's.
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are done before the forward starts

    def save_kv_layer(
        self, layer_name: str, kv_layer: Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # exports read the cache when asked

    def wait_for_save(self) -> None:
        return None


def register() -> None:
    """Make ``kv_connector="LanewayConnector"`` known to vLLM; once a process."""
    # Registered already where an engine was opened before.
    with contextlib.suppress(ValueError):
        KVConnectorFactory.register_connector(CONNECTOR, __name__, LanewayConnector.__name__)
