"""``TorchEngine`` end to end: whatever the scheduler does (batching, chunked prefill, prefix hits,
preemption), greedy output equals full-recompute greedy decoding."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import services.engine.torch_engine.engine as engine_module
from services.engine.protocol import BlocksRemoved, RequestOutput
from services.engine.torch_engine.sampler import RequestSampler, sample
from tests.engine._sim_support import fold

from ._support import (
    greedy_reference,
    make_engine,
    make_request,
    outputs_by_request,
    random_prompt,
    run_to_end,
    tokens_by_request,
)
from .tiny_checkpoint import write_tiny_checkpoint

# float32, logits of standard deviation about 4; measured differences stay below 2e-5.
ATOL = 1e-4


def test_batched_greedy_matches_full_recompute_tokens_and_logits(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=48)
    gen = torch.Generator().manual_seed(1)
    prompts = {f"r{n}": random_prompt(gen, n) for n in (1, 3, 4, 9, 17, 33)}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=6 + len(prompt) % 5))

    # The logits each step samples from, one row per output in output order.
    rows: list[torch.Tensor] = []

    def capture(logits: torch.Tensor, samplers: list[RequestSampler]) -> list[int]:
        rows.extend(logits)
        return sample(logits, samplers)

    monkeypatch.setattr(engine_module, "sample", capture)
    sequences = {rid: list(p) for rid, p in prompts.items()}
    busiest = 0
    while engine.has_work():
        rows.clear()
        result = engine.step()
        busiest = max(busiest, len(result.outputs))
        assert len(rows) == len(result.outputs)
        for out, row in zip(result.outputs, rows, strict=True):
            expected = engine.model.forward_full(torch.tensor(sequences[out.request_id]))[-1]
            torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
            sequences[out.request_id].extend(out.new_token_ids)
    assert busiest == len(prompts)
    for rid, prompt in prompts.items():
        generated = sequences[rid][len(prompt) :]
        assert generated == greedy_reference(engine.model, prompt, len(generated))


def test_prefix_cache_hits_skip_cached_blocks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    gen = torch.Generator().manual_seed(2)
    shared = random_prompt(gen, 20)
    first = make_request("first", shared + random_prompt(gen, 3))
    engine.add_request(first)
    run_to_end(engine)

    second = shared + random_prompt(gen, 6)
    engine.add_request(make_request("second", second))
    # The last prompt token is always computed, so a prompt of exactly 5 blocks hits 4 of them.
    engine.add_request(make_request("exact", shared))
    results = run_to_end(engine)
    outputs = outputs_by_request(results)
    assert outputs["second"][0].cached_tokens == 20
    assert outputs["exact"][0].cached_tokens == 16
    assert results[0].prefill_tokens == (len(second) - 20) + (len(shared) - 16)
    tokens = tokens_by_request(results)
    assert tokens["second"] == greedy_reference(engine.model, second, 8)
    assert tokens["exact"] == greedy_reference(engine.model, shared, 8)


def test_chunked_prefill_matches_full_recompute(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    prompt = random_prompt(torch.Generator().manual_seed(3), 50)
    engine.add_request(make_request("long", prompt, max_tokens=5))
    results = run_to_end(engine)
    assert [r.prefill_tokens for r in results[:4]] == [16, 16, 16, 2]
    assert [len(r.outputs) for r in results[:4]] == [0, 0, 0, 1]
    assert tokens_by_request(results)["long"] == greedy_reference(engine.model, prompt, 5)


def test_preemption_recomputes_and_keeps_the_tokens(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks=12)
    gen = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": random_prompt(gen, 10) for i in range(4)}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=20))
    tokens = tokens_by_request(run_to_end(engine))
    assert engine.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == greedy_reference(engine.model, prompt, 20)


def test_random_workload_matches_reference_and_kv_events_fold(tiny_model_dir: Path) -> None:
    """Prefix hits, private duplicates, evictions, preemptions and aborts at once: each step's KV
    events fold to the cached set, and every finished request has the reference's tokens."""
    rng = random.Random(5)
    engine = make_engine(
        tiny_model_dir, num_gpu_blocks=16, max_num_seqs=6, max_num_batched_tokens=20
    )
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    prompts: dict[str, list[int]] = {}
    aborted: set[str] = set()
    outputs: dict[str, list[RequestOutput]] = {}
    view: set[int] = set()
    evictions = 0
    while len(prompts) < 40 or engine.has_work():
        if len(prompts) < 40 and rng.random() < 0.8:
            rid = f"r{len(prompts)}"
            prompts[rid] = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(3)]
            engine.add_request(make_request(rid, prompts[rid], max_tokens=rng.randint(1, 20)))
        live = [rid for rid in prompts if rid not in aborted and not _finished(outputs, rid)]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert engine.abort(victim)
            aborted.add(victim)
        result = engine.step()
        fold(result.kv_changes, view)
        evictions += sum(isinstance(c, BlocksRemoved) for c in result.kv_changes)
        assert view == engine.cached_block_hashes()
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.num_preemptions > 0
    assert evictions > 0
    assert engine.load().kv_blocks_used == 0
    hits = 0
    for rid, prompt in prompts.items():
        if rid in aborted:
            continue
        outs = outputs[rid]
        hits += outs[0].cached_tokens or 0
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == greedy_reference(engine.model, prompt, len(tokens)), rid
    assert hits > 0


def _finished(outputs: dict[str, list[RequestOutput]], rid: str) -> bool:
    outs = outputs.get(rid)
    return outs is not None and bool(outs) and outs[-1].finished


def test_seeded_sampling_is_reproducible_alone_or_batched(tiny_model_dir: Path) -> None:
    prompt = random_prompt(torch.Generator().manual_seed(6), 7)

    def sampled(seed: int | None, with_company: bool) -> list[int]:
        engine = make_engine(tiny_model_dir)
        if with_company:
            engine.add_request(make_request("other", [5, 6, 7], max_tokens=4, temperature=1.0))
        engine.add_request(
            make_request("me", prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        )
        return tokens_by_request(run_to_end(engine))["me"]

    alone = sampled(7, with_company=False)
    assert sampled(7, with_company=True) == alone
    assert sampled(8, with_company=False) != alone
    # Without a seed, the request id seeds it: the same request samples the same tokens.
    assert sampled(None, with_company=False) == sampled(None, with_company=True)


def test_stop_token_and_eos_end_with_stop(tmp_path: Path) -> None:
    prompt = [11, 12, 13]
    folder = write_tiny_checkpoint(tmp_path / "a")
    reference = greedy_reference(make_engine(folder).model, prompt, 4)
    # A model whose end-of-sequence token is the second greedy token; the weights are the same.
    eos_folder = write_tiny_checkpoint(tmp_path / "b", eos_token_id=reference[1])
    engine = make_engine(eos_folder)
    engine.add_request(make_request("eos", prompt, max_tokens=4, ignore_eos=False))
    engine.add_request(make_request("ignore", prompt, max_tokens=4, ignore_eos=True))
    engine.add_request(make_request("stop", prompt, max_tokens=4, stop_token_ids=(reference[2],)))
    outputs = outputs_by_request(run_to_end(engine))
    assert [t for o in outputs["eos"] for t in o.new_token_ids] == reference[:2]
    assert outputs["eos"][-1].finish_reason == "stop"
    assert [t for o in outputs["ignore"] for t in o.new_token_ids] == reference
    assert outputs["ignore"][-1].finish_reason == "length"
    assert [t for o in outputs["stop"] for t in o.new_token_ids] == reference[:3]
    assert outputs["stop"][-1].finish_reason == "stop"


def test_abort_frees_blocks(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=1)
    engine.add_request(make_request("running", list(range(3, 20)), max_tokens=50))
    engine.add_request(make_request("waiting", list(range(3, 9))))
    engine.step()
    engine.step()
    load = engine.load()
    assert (load.running, load.waiting, load.kv_blocks_used) == (1, 1, 5)
    assert engine.abort("waiting")
    assert engine.abort("running")
    assert not engine.abort("running")
    assert not engine.has_work()
    load = engine.load()
    assert (load.running, load.waiting, load.kv_blocks_used) == (0, 0, 0)
    assert load.waiting_prefill_tokens == 0


def test_rejects_requests_it_cannot_serve(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_gpu_blocks=8)
    engine.add_request(make_request("a", [5]))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(make_request("a", [5]))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(make_request("b", [5, 300]))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(make_request("c", [5] * 30, max_tokens=10))
    roomy = make_engine(tiny_model_dir, num_gpu_blocks=256)
    with pytest.raises(ValueError, match="positions"):
        roomy.add_request(make_request("d", [5] * 500, max_tokens=20))
    # What it declares is the tighter of its KV pool and its model's positions.
    assert (engine.max_model_len, roomy.max_model_len) == (8 * engine.block_size, 512)


def test_step_reports_measured_time_and_prefill(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.add_request(make_request("a", list(range(3, 14)), max_tokens=2))
    first = engine.step()
    assert first.prefill_tokens == 11
    assert first.duration_s > 0.0
    assert engine.step().prefill_tokens == 0
    assert engine.step().outputs == []
