"""Token-id prompts from a trace's block ids, for a live replay on a model with a tokenizer of
its own (`laneway bench --mode live --engine vllm`): equal ids give equal tokens, every token an
ordinary one of the model's vocabulary, and the bench's block hashes are those the ingress makes
of the ids; the slice flags that fit a trace to a small model; and the refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from infra.bench.model_prompts import check_model_vocabulary, fit_to_model, model_context
from infra.bench.traces import (
    PROMPT_TOKEN_IDS,
    PromptFactory,
    TraceRequest,
    capped,
    check_token_ids,
    conversation,
    load_trace,
    sample_conversations,
    with_block_unit,
)
from infra.cli import main
from schemas.block_hash import chain_block_hashes, salt_root
from schemas.cache_salt import request_salt


def test_32_tokens_per_hash_id_equal_ids_equal_tokens_hashed_as_the_ingress_does(
    small_trace: Path,
) -> None:
    original = load_trace(small_trace)
    trace = with_block_unit(original, 32)
    prompts = PromptFactory(32)
    block: dict[int, list[int]] = {}
    for before, request in zip(original, trace, strict=True):
        ids = prompts.prompt(request).token_ids()
        # A sixteenth of the prompt, rounded up: the last block keeps the share it filled.
        assert len(ids) == request.input_length == -(-before.input_length // 16)
        assert request.hash_ids == before.hash_ids and request.block_unit == 32
        assert set(ids) <= PROMPT_TOKEN_IDS
        for k, hash_id in enumerate(request.hash_ids):
            tokens = ids[k * 32 : (k + 1) * 32]
            if len(tokens) == 32:  # a full block: the same wherever its id comes
                assert block.setdefault(hash_id, tokens) == tokens
        # What the ingress hashes a token-id prompt to, salted or not (services.ingress.intake).
        assert prompts.block_hashes(request) == chain_block_hashes(ids, 32)
        salt = request_salt("group-salt", None)
        salted = replace(request, cache_salt=salt)
        assert prompts.block_hashes(salted) == chain_block_hashes(ids, 32, salt_root(salt))
    assert len(set(map(tuple, block.values()))) == len(block)  # different ids, different tokens


def test_prompts_are_cut_to_a_prefix_of_themselves_and_outputs_to_the_cap(
    small_trace: Path,
) -> None:
    trace = with_block_unit(load_trace(small_trace), 32)
    cut = capped(trace, 70, 6)
    prompts = PromptFactory(32)
    for whole, short in zip(trace, cut, strict=True):
        assert short.input_length == min(whole.input_length, 70)
        assert short.hash_ids == whole.hash_ids[: -(-short.input_length // 32)]
        full = prompts.prompt(whole).token_ids()
        assert prompts.prompt(short).token_ids() == full[: short.input_length]
        assert short.output_length == min(whole.output_length, 6)
    assert capped(trace, None, None) == trace
    with pytest.raises(ValueError):
        capped(trace, 0, None)


def test_a_conversation_sample_keeps_every_turn_of_every_kth_conversation() -> None:
    # Four conversations of three turns after one shared system-prompt block (id 0), as the
    # Mooncake trace's: turn t of conversation c at 10 c + 100 t seconds, extending the last.
    trace = [
        TraceRequest(10.0 * c + 100.0 * t + 5, 512 * (1 + 2 * t), 8, ids, 0)
        for t in range(3)
        for c in range(4)
        for ids in [(0, *range(100 * c + 1, 100 * c + 2 + 2 * t))]
    ]
    trace = [replace(r, index=i) for i, r in enumerate(trace)]
    kept = sample_conversations(trace, 2)
    assert [(r.index, r.arrival_s) for r in kept] == [
        (0, 0.0), (2, 20.0), (4, 100.0), (6, 120.0), (8, 200.0), (10, 220.0)
    ]  # fmt: skip
    # Numbered as they first arrive in what is sampled: from conversation 1 on, 1 and 3 first.
    assert {r.hash_ids[1] for r in sample_conversations(trace[1:], 2)} == {101, 301}
    assert sample_conversations(trace, 1) == [replace(r, arrival_s=r.arrival_s - 5) for r in trace]
    assert len({conversation(r) for r in trace}) == 4


def test_the_tokens_must_be_ordinary_ones_of_the_model(made_model: Path) -> None:
    check_model_vocabulary(made_model)  # `laneway make-tiny-model`: 2,042 ids, 0-2 special
    check_token_ids(max(PROMPT_TOKEN_IDS) + 1, [0, 1, 2])
    with pytest.raises(ValueError, match="reach"):
        check_token_ids(max(PROMPT_TOKEN_IDS), [])
    with pytest.raises(ValueError, match="special"):
        check_token_ids(2048, [min(PROMPT_TOKEN_IDS)])


def test_prompts_fit_the_model_beside_the_longest_output(
    small_trace: Path, made_model: Path
) -> None:
    trace = capped(load_trace(small_trace), None, 40)  # the tiny model holds 4,096 positions
    room = model_context(made_model) - max(r.output_length for r in trace)
    fitted = fit_to_model(trace, made_model, None)
    assert max(r.input_length for r in fitted) == room < max(r.input_length for r in trace)
    assert fit_to_model(trace, made_model, 100) == capped(trace, 100, None)
    with pytest.raises(ValueError, match="do not fit"):
        fit_to_model(trace, made_model, room + 1)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--engine", "vllm", "--model", "{model}"], "live only"),
        (["--mode", "live", "--engine", "vllm", "--model", "{model}", "--time-scale", "2"],
         "--time-scale is for the sim engine"),
        (["--mode", "live", "--kv-cache-gib", "1"], "--kv-cache-gib is for --engine vllm"),
    ],
)  # fmt: skip
def test_the_engine_flags_refuse_what_cannot_be_measured(
    flags: list[str],
    why: str,
    small_trace: Path,
    made_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [f.format(model=made_model) for f in flags]
    assert main(["bench", "--trace", str(small_trace), *args]) == 2
    assert why in capsys.readouterr().err


def test_vllm_needs_a_model_folder(small_trace: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs --model DIR"):
        main(["bench", "--trace", str(small_trace), "--mode", "live", "--engine", "vllm"])
    with pytest.raises(SystemExit, match="needs --model DIR"):
        main(["bench", "--trace", str(small_trace), "--mode", "live", "--engine", "vllm",
              "--model", str(tmp_path)])  # fmt: skip
