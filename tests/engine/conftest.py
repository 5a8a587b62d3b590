"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from .vllm_pool import VllmPool


@pytest.fixture(scope="session")
def vllm_pool(vllm_model: Path) -> VllmPool:
    """Two vLLM engines of the contract's shape, for every engine test in this process."""
    return VllmPool(vllm_model)
