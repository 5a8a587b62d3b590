"""A worker's context limit: its engine's, or a lower one it is given."""

from __future__ import annotations

import pytest

from services.worker.settings import WorkerSettings, build_engine, worker_options


def options_of(**settings: object) -> int | None:
    worker = WorkerSettings(worker_id="w", **settings)  # type: ignore[arg-type]
    engine, _ = build_engine(worker)
    return worker_options(worker, engine).max_model_len


def test_the_sim_holds_its_whole_kv_pool() -> None:
    engine, _ = build_engine(WorkerSettings(block_size=16, num_gpu_blocks=4096))
    assert engine.max_model_len == 65_536
    # Unset: the worker registers its engine's limit.
    assert options_of(block_size=16, num_gpu_blocks=4096) is None


def test_a_lower_limit_is_taken() -> None:
    assert options_of(num_gpu_blocks=4096, max_model_len=1000) == 1000


def test_a_limit_the_engine_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match=r"LANEWAY_MAX_MODEL_LEN=70000 .*at most 65536 tokens"):
        options_of(block_size=16, num_gpu_blocks=4096, max_model_len=70_000)
