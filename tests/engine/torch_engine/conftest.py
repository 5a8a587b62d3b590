"""Fixtures of the torch engine's tests: one tiny random checkpoint for the whole session."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.torch_engine.tiny import make_tiny_model

from .tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def made_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `laneway make-tiny-model` writes, with its trained tokenizer."""
    directory = tmp_path_factory.mktemp("product-tiny")
    make_tiny_model(directory)
    return directory
