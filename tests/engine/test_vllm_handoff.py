"""vLLM's side of a KV hand-off beyond the engine contract: the KV goes into vLLM through
Laneway's KV connector, lands in the blocks vLLM then serves the request from, and nothing staged
for it outlives the request. Two pooled engines (``vllm_pool``) and ``KvStage`` on its own."""

from __future__ import annotations

import pytest
import torch

from schemas.block_hash import chain_block_hashes, salt_root
from schemas.events import SamplingParams
from services.engine.kv_payload import pack, unpack
from services.engine.protocol import EngineRequest, StepResult

from ._sim_support import outputs_by_request, run_to_end
from .vllm_pool import VllmPool

BLOCK = 32
ROOT = salt_root("a tenant's cache group")
# Three full blocks and 9 tokens, in a salted chain: as a worker behind API keys sends them.
PROMPT = [3 + (11 * k) % 290 for k in range(3 * BLOCK + 9)]
HASHES = chain_block_hashes(PROMPT, BLOCK, ROOT)


def salted(request_id: str, prompt: list[int], max_tokens: int = 6) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hashes = chain_block_hashes(prompt, BLOCK, ROOT)
    return EngineRequest(request_id, tuple(prompt), sampling, hashes, ROOT)


def tokens(results: list[StepResult], request_id: str) -> list[int]:
    return [t for out in outputs_by_request(results)[request_id] for t in out.new_token_ids]


def test_handed_off_blocks_are_loaded_past_vllms_own_hit_and_served_from(
    vllm_pool: VllmPool,
) -> None:
    source = vllm_pool.fresh()
    source.add_request(salted("r", PROMPT))
    local = tokens(run_to_end(source), "r")
    count, payload = source.export_prefix(HASHES)
    assert count == len(HASHES)
    decode = vllm_pool.fresh()
    # The decode engine holds the first block already, from a prompt that shares it.
    decode.add_request(salted("other", [*PROMPT[:BLOCK], *range(200, 240)], max_tokens=1))
    run_to_end(decode)
    assert decode.import_prefix(HASHES, payload) == len(HASHES)
    decode.add_request(salted("r", PROMPT))
    results = run_to_end(decode)
    # vLLM found one block itself and loaded two: it computed the 9 tokens after them alone.
    assert outputs_by_request(results)["r"][0].cached_tokens == 3 * BLOCK
    assert sum(r.prefill_tokens for r in results) == 9
    assert tokens(results, "r") == local
    # Served from the blocks the payload filled: the decode engine's cache now holds its KV.
    held, again = decode.export_prefix(HASHES)
    assert held == len(HASHES)
    assert torch.equal(unpack(again)[1]["kv"], unpack(payload)[1]["kv"])
    assert len(decode._stage) == 0


def test_the_loaded_kv_is_the_payloads_not_recomputed(vllm_pool: VllmPool) -> None:
    """A payload of zeros under the prompt's hashes: vLLM serves the request from what came
    (the blocks read back zero), which a recompute would have overwritten."""
    source = vllm_pool.fresh()
    source.add_request(salted("r", PROMPT, max_tokens=1))
    run_to_end(source)
    _, payload = source.export_prefix(HASHES)
    hashes, tensors = unpack(payload)
    decode = vllm_pool.fresh()
    decode.import_prefix(HASHES, pack(hashes, {"kv": torch.zeros_like(tensors["kv"])}))
    decode.add_request(salted("r", PROMPT, max_tokens=1))
    run_to_end(decode)
    kv = unpack(decode.export_prefix(HASHES)[1])[1]["kv"]
    assert not torch.any(kv) and torch.any(tensors["kv"])


def test_staged_blocks_go_with_an_aborted_request_and_a_refused_payload(
    vllm_pool: VllmPool,
) -> None:
    source = vllm_pool.fresh()
    source.add_request(salted("r", PROMPT, max_tokens=1))
    run_to_end(source)
    _, payload = source.export_prefix(HASHES)
    decode = vllm_pool.fresh()
    assert decode.import_prefix(HASHES, payload) == len(HASHES)
    decode.add_request(salted("r", PROMPT))
    assert decode.abort("r")
    run_to_end(decode)
    assert len(decode._stage) == 0
    # Another prompt's blocks, or another salt's, are not these.
    with pytest.raises(ValueError, match="prefix"):
        decode.import_prefix(chain_block_hashes(PROMPT, BLOCK), payload)
    assert len(decode._stage) == 0


def test_a_stage_holds_its_capacity_and_refuses_what_does_not_fit() -> None:
    from services.engine.vllm_engine.compat import import_vllm

    import_vllm()
    from services.engine.vllm_engine.connector import KvStage

    # Two layers of four blocks, each [1 head, 2 tokens, 3 channels].
    layers = [torch.zeros(4, 1, 2, 3), torch.zeros(4, 1, 2, 3)]
    stage = KvStage()
    stage.attach(layers, capacity=2)
    blocks = torch.arange(3 * 2 * 6, dtype=torch.float32).reshape(3, 2, 1, 2, 3)
    assert stage.stage(pack((7, 8, 9), {"kv": blocks}), (7, 8, 9, 10)) == 3
    # The oldest went: 8 and 9 wait.
    assert len(stage) == 2 and stage.run((7, 8, 9), 0) == 0 and stage.run((7, 8, 9), 1) == 2
    assert stage.load((8, 9), (3, 0)) == []
    assert torch.equal(layers[1][3], blocks[1, 1]) and torch.equal(layers[0][0], blocks[2, 0])
    assert len(stage) == 0
    # Taken once: a second load of them fails, and vLLM recomputes those blocks.
    assert stage.load((9,), (1,)) == [1]
    with pytest.raises(ValueError, match="does not fit"):
        stage.stage(pack((7,), {"kv": torch.zeros(1, 2, 1, 2, 4)}), (7,))
    with pytest.raises(ValueError, match="does not fit"):
        stage.stage(pack((7,), {"kv": blocks[:1].half()}), (7,))
