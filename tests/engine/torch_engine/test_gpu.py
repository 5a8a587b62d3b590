"""The engine on a CUDA device: the same greedy tokens as the CPU reference in float32, and a
working half-precision path. Run with ``-m gpu`` on a machine with a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.block_hash import chain_block_hashes
from services.engine.torch_engine import load_model
from services.engine.torch_engine.export import from_bytes

from ._support import (
    SMALL,
    greedy_reference,
    make_engine,
    make_request,
    random_prompt,
    run_to_end,
    tokens_by_request,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_float32_matches_the_cpu_reference(tiny_model_dir: Path) -> None:
    reference_model = load_model(tiny_model_dir, torch.device("cpu"), torch.float32)
    engine = make_engine(tiny_model_dir, device="cuda", num_gpu_blocks=16)
    gen = torch.Generator().manual_seed(0)
    prompts = {f"r{n}": random_prompt(gen, n) for n in (2, 7, 19, 30)}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=12))
    tokens = tokens_by_request(run_to_end(engine))
    assert engine.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == greedy_reference(reference_model, prompt, 12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_generates_and_exports(tiny_model_dir: Path, dtype: str) -> None:
    engine = make_engine(tiny_model_dir, device="cuda", dtype=dtype)
    engine.add_request(make_request("r", list(range(3, 30)), max_tokens=6))
    engine.step()
    _, data = engine.export_prefix(chain_block_hashes(list(range(3, 30)), SMALL["block_size"]))
    export = from_bytes(data)
    assert export.key.dtype == getattr(torch, dtype)
    assert export.key.device.type == "cpu"
    assert len(tokens_by_request(run_to_end(engine))["r"]) == 5
    other = make_engine(tiny_model_dir, device="cuda", dtype=dtype)
    assert other.import_kv(export) == 6
