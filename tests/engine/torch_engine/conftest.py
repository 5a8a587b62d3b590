"""Fixtures of the torch engine's tests: one tiny random checkpoint for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
