"""KV hand-off: blocks one engine exports after a prefill serve the same request on another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.block_hash import chain_block_hashes
from services.engine.protocol import BlocksStored
from services.engine.torch_engine import KvExport, TorchEngine
from services.engine.torch_engine.export import from_bytes, to_bytes
from tests.engine._sim_support import fold

from ._support import make_engine, make_request, outputs_by_request, random_prompt, run_to_end

PROMPT = random_prompt(torch.Generator().manual_seed(9), 22)


def _prefill_and_export(engine: TorchEngine, temperature: float) -> tuple[KvExport, list[int]]:
    """The export after the prefill step, and the tokens the engine then generates."""
    engine.add_request(make_request("r", PROMPT, max_tokens=10, temperature=temperature, seed=3))
    first = engine.step()
    exported, data = engine.export_prefix(chain_block_hashes(PROMPT, 4))
    export = from_bytes(data)
    assert exported == len(export.block_hashes)
    outputs = first.outputs + [o for r in run_to_end(engine) for o in r.outputs]
    return export, [t for o in outputs for t in o.new_token_ids]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_imported_prefix_hits_and_generates_the_same_tokens(
    tiny_model_dir: Path, temperature: float
) -> None:
    export, source_tokens = _prefill_and_export(make_engine(tiny_model_dir), temperature)
    assert export.block_hashes == chain_block_hashes(PROMPT, 4)
    assert export.key.shape == (2, 5, 4, 2, 16)
    assert export.key.device.type == "cpu"

    target = make_engine(tiny_model_dir)
    assert target.import_kv(export) == 5
    assert target.import_kv(export) == 0
    target.add_request(make_request("r", PROMPT, max_tokens=10, temperature=temperature, seed=3))
    results = run_to_end(target)
    view: set[int] = set()
    for result in results:
        fold(result.kv_changes, view)
    assert view == target.cached_block_hashes()
    assert results[0].kv_changes[0] == BlocksStored(export.block_hashes, None)
    assert results[0].prefill_tokens == len(PROMPT) - 20
    outputs = outputs_by_request(results)["r"]
    assert outputs[0].cached_tokens == 20
    assert [t for o in outputs for t in o.new_token_ids] == source_tokens


def test_import_stops_when_the_pool_is_full(tiny_model_dir: Path) -> None:
    export, _ = _prefill_and_export(make_engine(tiny_model_dir), 0.0)
    target = make_engine(tiny_model_dir, num_gpu_blocks=8)
    # Three blocks held by a running request leave five free.
    target.add_request(make_request("busy", list(range(3, 15)), max_tokens=20))
    target.step()
    assert target.import_kv(export) == 5
    other = make_engine(tiny_model_dir, num_gpu_blocks=8)
    other.add_request(make_request("busy", list(range(3, 27)), max_tokens=2))
    other.step()
    assert other.import_kv(export) == 2
    assert other.cached_block_hashes() >= set(export.block_hashes[:2])
    assert not other.cached_block_hashes() & set(export.block_hashes[2:])


def test_import_rejects_another_layout(tiny_model_dir: Path) -> None:
    export, _ = _prefill_and_export(make_engine(tiny_model_dir), 0.0)
    with pytest.raises(ValueError, match="layout"):
        make_engine(tiny_model_dir, block_size=8).import_kv(export)


def test_the_wire_format_keeps_64_bit_hashes_and_tensors(tiny_model_dir: Path) -> None:
    export, _ = _prefill_and_export(make_engine(tiny_model_dir), 0.0)
    odd = KvExport(
        export.layout, ((1 << 64) - 1, 1 << 63, *export.block_hashes[2:]), export.key, export.value
    )
    back = from_bytes(to_bytes(odd))
    assert back.block_hashes == odd.block_hashes and back.layout == odd.layout
    assert torch.equal(back.key, odd.key) and torch.equal(back.value, odd.value)


def test_import_takes_only_a_prefix_of_the_request(tiny_model_dir: Path) -> None:
    source = make_engine(tiny_model_dir)
    source.add_request(make_request("r", PROMPT, max_tokens=2))
    source.step()
    hashes = chain_block_hashes(PROMPT, 4)
    exported, data = source.export_prefix(hashes)
    assert exported == 5
    target = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match="prefix"):
        target.import_prefix(chain_block_hashes([7, *PROMPT], 4), data)
    assert target.import_prefix(hashes, data) == 5
    # Nothing cached: nothing to send, and nothing to take.
    assert source.export_prefix(chain_block_hashes([9] * 8, 4))[0] == 0
