"""A worker's settings (``LANEWAY_*``), the engine they describe, and the runtime options taken
from both."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from bus.settings import ServiceSettings
from schemas.events import Role, new_id
from schemas.messages import DEFAULT_MODEL
from services.common.kv_transfer import KvTransferModel
from services.common.tokenizer import ByteTokenizer, Tokenizer
from services.engine.protocol import Engine
from services.engine.sim import SimConfig, SimEngine, perf_model

_LINK = KvTransferModel()


@dataclass
class WorkerOptions:
    worker_id: str
    role: Role
    engine_kind: str
    model: str
    speedup: float
    lease_ttl_s: int
    load_report_interval_s: float
    drain_timeout_s: float
    kv_events: bool = True
    # Most tokens, prompt and completion together, of a request it takes; None: all its engine
    # holds. Registered: the ingress answers longer requests with context_length_exceeded.
    max_model_len: int | None = None
    # A report of a move of its load (runtime.moved) at most this often (seconds): the planner's
    # queue estimates are only as fresh as the last report.
    busy_report_interval_s: float = 0.05
    # An ingress gets at most one token batch this often (seconds) while steps come faster; a
    # request's first tokens and its end go out at once. 0: every step's tokens at its end.
    token_interval_s: float = 0.001
    # A step's KV changes wait at most this long (seconds) for later steps' to go in one event:
    # the prefix index trails the worker's cache by this, plus a step, at most.
    kv_interval_s: float = 0.005
    # What a sim decode worker waits out for a hand-off's KV (a real engine's bytes take what
    # they take).
    kv_transfer: KvTransferModel = field(default_factory=KvTransferModel)
    # A decode worker waits for a remote prefill's KV this long, at least, or this many times
    # the planner's prediction, before it prefills locally instead.
    handoff_timeout_s: float = 5.0
    handoff_timeout_factor: float = 3.0
    # Where it runs, as registered: the planner prices a KV move by the link between two.
    node: str = ""
    rack: str = ""


class WorkerSettings(ServiceSettings):
    renamed: ClassVar[dict[str, str]] = {"LANEWAY_TIMING": "perf_model"}

    worker_id: str = Field(default_factory=new_id)
    role: Role = "both"
    # sim: simulated timing, real KV accounting. torch, trtllm, vllm: a real model from
    # `model_dir` (vllm: vLLM's engine in this process, services.engine.vllm_engine).
    engine: Literal["sim", "torch", "trtllm", "vllm"] = "sim"
    model: str = DEFAULT_MODEL
    # A Hugging Face layout folder (config.json, *.safetensors, tokenizer.json): torch engine.
    model_dir: Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_gpu_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Most tokens, prompt and completion together, of one request; unset: all the engine holds
    # (its model's positions and its KV pool: num_gpu_blocks × block_size for the sim).
    max_model_len: int | None = Field(default=None, gt=0)
    # Perf model of the sim engine: dynamo-mocker, or fixed (fast, for tests and demos).
    perf_model: str = "dynamo-mocker"
    # Modelled time is divided by this: 10 runs the simulated GPU ten times faster.
    speedup: float = Field(default=1.0, gt=0)
    # LoRA adapters held at once (vLLM's --max-loras), loaded on demand and least recently used
    # out beyond; 0: none (an adapter's requests go to other workers). sim and vllm engines.
    max_loras: int = Field(default=0, ge=0, le=1024)
    # What the sim engine models an adapter's load to take, in ms.
    sim_lora_load_ms: float = Field(default=150.0, ge=0)
    # False: behave like an engine that publishes no KV events (the indexer then predicts).
    kv_events: bool = True
    # A host-memory KV tier (blocks; 0: none), sim and torch engines: blocks the GPU evicts go
    # there, and a prompt continued there loads them instead of computing (the sim models the
    # load over this PCIe link, GB/s; the torch engine copies CPU tensors).
    host_kv_blocks: int = Field(default=0, ge=0)
    host_link_gb_s: float = Field(default=25.0, gt=0)
    # Where it runs ('' unknown): its node and, optionally, the node's rack.
    node: str = Field(default="", max_length=128)
    rack: str = Field(default="", max_length=128)
    lease_ttl_s: int = Field(default=5, ge=1, le=10)
    load_report_interval_s: float = 0.5
    busy_report_interval_s: float = 0.05
    token_interval_ms: float = Field(default=1.0, ge=0, le=50)
    kv_interval_ms: float = Field(default=5.0, ge=0, le=1000)
    drain_timeout_s: float = 5.0
    # vLLM: its KV cache's size in GiB (host memory on its CPU build; unset: vLLM's choice), the
    # share of GPU memory it may take, and any other of its engine arguments, as JSON
    # (LANEWAY_VLLM_ARGS='{"enforce_eager": true}'), which win over the settings above.
    kv_cache_gib: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    vllm_args: dict[str, Any] = Field(default_factory=dict)
    # The link a sim decode worker models for a hand-off's KV (see KvTransferModel).
    kv_bytes_per_token: int = _LINK.kv_bytes_per_token
    link_gb_s: float = _LINK.bandwidth_gb_s
    link_latency_ms: float = _LINK.latency_ms
    # A remote prefill's KV is waited for max(this, factor × predicted) seconds, then the decode
    # worker prefills locally.
    handoff_timeout_s: float = 5.0
    handoff_timeout_factor: float = 3.0


# The scheduler's settings, named alike in every engine that uses it.
_SCHEDULING = {"block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"}


def build_engine(settings: WorkerSettings) -> tuple[Engine, Tokenizer]:
    scheduling = settings.model_dump(include=_SCHEDULING)
    if settings.engine != "sim" and settings.model_dir is None:
        raise ValueError(f"the {settings.engine} engine needs LANEWAY_MODEL_DIR (a model folder)")
    if settings.max_loras and settings.engine in ("torch", "trtllm"):
        raise ValueError(
            f"the {settings.engine} engine serves no LoRA adapters: leave LANEWAY_MAX_LORAS unset "
            "(the sim and vllm engines serve them)"
        )
    if settings.engine == "trtllm":
        assert settings.model_dir is not None
        from services.common.hf_tokenizer import HfTokenizer
        from services.engine.trtllm_engine import TrtllmEngine, TrtllmEngineConfig

        trtllm = TrtllmEngine(
            TrtllmEngineConfig(
                settings.model_dir,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
            )
        )
        return trtllm, HfTokenizer(settings.model_dir)
    if settings.engine == "vllm":
        assert settings.model_dir is not None
        from services.common.hf_tokenizer import HfTokenizer
        from services.engine.vllm_engine import VllmEngine, VllmEngineConfig

        vllm = VllmEngine(
            VllmEngineConfig(
                settings.model_dir,
                block_size=settings.block_size,
                max_model_len=settings.max_model_len,
                max_num_seqs=settings.max_num_seqs,
                max_num_batched_tokens=settings.max_num_batched_tokens,
                dtype=settings.dtype,
                kv_cache_gib=settings.kv_cache_gib,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                max_loras=settings.max_loras,
                extra_args=settings.vllm_args,
            )
        )
        return vllm, HfTokenizer(settings.model_dir)
    if settings.engine == "torch":
        assert settings.model_dir is not None
        # Imported only here: sim workers start without loading torch.
        from services.common.hf_tokenizer import HfTokenizer
        from services.engine.torch_engine.config import TorchEngineConfig
        from services.engine.torch_engine.engine import TorchEngine

        engine = TorchEngine(
            settings.model_dir,
            TorchEngineConfig(
                **scheduling,
                device=settings.device,
                dtype=settings.dtype,
                num_host_blocks=settings.host_kv_blocks,
            ),
        )
        return engine, HfTokenizer(settings.model_dir)
    sim = SimConfig(
        **scheduling,
        num_host_blocks=settings.host_kv_blocks,
        host_link_gb_s=settings.host_link_gb_s,
        max_loras=settings.max_loras,
        lora_load_ms=settings.sim_lora_load_ms,
    )
    return SimEngine(sim, perf_model(settings.perf_model)), ByteTokenizer()


def _max_model_len(settings: WorkerSettings, engine: Engine) -> int | None:
    """The setting's context limit, refused if the engine cannot hold it: a limit silently
    lowered would leave the operator wondering why long prompts still fail."""
    wanted = settings.max_model_len
    if wanted is not None and wanted > engine.max_model_len:
        raise ValueError(
            f"LANEWAY_MAX_MODEL_LEN={wanted} is more than the {settings.engine} engine holds "
            f"(at most {engine.max_model_len} tokens: its context and its "
            f"{engine.kv_blocks_total} KV blocks of {engine.block_size})"
        )
    return wanted


def worker_options(settings: WorkerSettings, engine: Engine) -> WorkerOptions:
    return WorkerOptions(
        worker_id=settings.worker_id,
        role=settings.role,
        engine_kind=settings.engine,
        model=settings.model,
        speedup=settings.speedup,
        lease_ttl_s=settings.lease_ttl_s,
        load_report_interval_s=settings.load_report_interval_s,
        busy_report_interval_s=settings.busy_report_interval_s,
        token_interval_s=settings.token_interval_ms / 1000,
        kv_interval_s=settings.kv_interval_ms / 1000,
        drain_timeout_s=settings.drain_timeout_s,
        kv_events=settings.kv_events and engine.capabilities.kv_events,
        max_model_len=_max_model_len(settings, engine),
        kv_transfer=KvTransferModel(
            settings.kv_bytes_per_token, settings.link_gb_s, settings.link_latency_ms
        ),
        handoff_timeout_s=settings.handoff_timeout_s,
        handoff_timeout_factor=settings.handoff_timeout_factor,
        node=settings.node,
        rack=settings.rack,
    )
