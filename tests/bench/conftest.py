from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    """A Mooncake-format trace of three conversations, each turn extending the last."""
    rng = random.Random(1)
    rows = []
    next_id = 0
    for conv in range(3):
        ids: list[int] = []
        for turn in range(4):
            new = list(range(next_id, next_id + rng.randint(1, 3)))
            next_id += len(new)
            ids += new
            rows.append(
                {
                    "timestamp": conv * 700 + turn * 2000,
                    "input_length": len(ids) * 512 - rng.randint(0, 300),
                    "output_length": rng.randint(5, 40),
                    "hash_ids": list(ids),
                }
            )
    rows.sort(key=lambda r: r["timestamp"])
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def mooncake_trace() -> Path:
    path = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path
