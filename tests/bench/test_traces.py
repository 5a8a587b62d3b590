from __future__ import annotations

from pathlib import Path

import pytest

from infra.bench.traces import PromptFactory, block_tokens, load_trace
from schemas.block_hash import chain_block_hashes


def test_mooncake_requests_share_exactly_their_common_blocks(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    factory = PromptFactory(64)
    for request in trace:
        tokens = factory.prompt(request).tokens()
        assert len(tokens) == request.input_length
        assert factory.block_hashes(request) == chain_block_hashes(list(tokens), 64)
    first, second = trace[0], next(r for r in trace[1:] if r.hash_ids[0] == trace[0].hash_ids[0])
    shared = len(first.hash_ids) - 1  # the last block of the first turn is partial
    a, b = factory.block_hashes(first), factory.block_hashes(second)
    assert a[: shared * 8] == b[: shared * 8]


def test_block_tokens_are_printable_and_fixed_by_the_id() -> None:
    assert block_tokens(7) == block_tokens(7)
    assert block_tokens(7) != block_tokens(8)
    assert block_tokens(7).decode("ascii").isprintable()
    assert block_tokens(7, 100) == block_tokens(7)[:100]


def test_speedup_divides_the_gaps(small_trace: Path) -> None:
    normal = load_trace(small_trace)
    fast = load_trace(small_trace, speedup=4)
    assert [r.arrival_s / 4 for r in normal] == pytest.approx([r.arrival_s for r in fast])
    assert len(load_trace(small_trace, limit=5)) == 5


def test_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    trace = load_trace(path)
    assert [(r.input_length, r.output_length) for r in trace] == [(374, 44), (396, 109)]
    assert trace[1].arrival_s == pytest.approx(4.3145790)
    factory = PromptFactory(64)
    # No sharing information: no two requests share a block.
    assert not set(factory.block_hashes(trace[0])) & set(factory.block_hashes(trace[1]))


def test_a_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_trace(path)


def test_a_trace_line_may_name_its_adapter(tmp_path: Path) -> None:
    path = tmp_path / "adapters.jsonl"
    line = '{"timestamp": %d, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]%s}\n'
    path.write_text(
        line % (0, ', "lora": "sql"') + line % (10, ', "lora": "chat"') + line % (20, "")
    )
    trace = load_trace(path)
    assert [r.lora for r in trace] == ["sql", "chat", None]
    factory = PromptFactory(64)
    hashes = [factory.block_hashes(r)[0] for r in trace]
    # The same blocks, three caches: an adapter's prompt is salted as the ingress salts it.
    assert len(set(hashes)) == 3
    assert trace[2].cache_salt is None
    path.write_text(line % (0, ', "lora": 7'))
    with pytest.raises(ValueError, match="adapter"):
        load_trace(path)
