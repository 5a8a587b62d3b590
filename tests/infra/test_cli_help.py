"""Every `laneway` command's --help names each flag's default and choices."""

from __future__ import annotations

import argparse
import re

import pytest

from infra.cli import build_parser, main
from services.common.perf_model import PERF_MODEL_NAMES
from services.planner.policy_registry import POLICY_NAMES


def _commands(
    parser: argparse.ArgumentParser | None = None, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    """Every command by its name, a command's own commands as `record export`."""
    parser = parser or build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, command in sub.choices.items():
        nested = any(isinstance(a, argparse._SubParsersAction) for a in command._actions)
        commands |= _commands(command, f"{prefix}{name} ") if nested else {prefix + name: command}
    return commands


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # No wrapping: argparse would break a long default at its hyphens.
    monkeypatch.setenv("COLUMNS", "1000")


def _help(command: str) -> str:
    # Help columns are padded with spaces: compare with single spaces.
    return re.sub(r"\s+", " ", _commands()[command].format_help())


def test_up_shows_defaults_and_choices() -> None:
    text = _help("up")
    for shown in (
        "--workers WORKERS workers that decode (aggregated without a prefill pool) (default: 2)",
        "prefill-only workers (default: 0)",
        "routing policy of the planner (default: kv)",
        "--disagg {never,always,auto}",
        "(default: auto)",
        f"--perf-model {{{','.join(PERF_MODEL_NAMES)}}}",
        "(default: dynamo-mocker)",
        "--engine {sim,torch,trtllm,vllm} worker engine;",
        "one token per UTF-8 byte of the prompt (its chat template included) (default: sim)",
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "(default: .state)",
    ):
        assert shown in text
    assert f"--policy {{{','.join(POLICY_NAMES)}}}" in text
    # Flags with nothing to show do not claim a default.
    assert "(default: None)" not in text and "(default: False)" not in text


def test_bench_shows_defaults_and_choices() -> None:
    text = _help("bench")
    for shown in (
        "all workers (both roles) (default: 8)",
        "--mode {offline,live}",
        "(default: offline)",
        f"--perf-model {{{','.join(PERF_MODEL_NAMES)}}}",
        "--disagg {never,always,auto}",
        "divides inter-arrival gaps (default: 1.0)",
        "tokens per KV block (default: sim 64, vllm 32)",
        "repeatable (default: all)",
    ):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_every_flag_of_every_command_says_what_it_does_and_its_default() -> None:
    commands = _commands()
    assert {"up", "bench", "bench-engine", "make-tiny-model", "record export"} <= set(commands)
    for name, command in commands.items():
        text = _help(name)
        for action in command._actions:
            assert action.help, (name, action.dest)
            if action.default not in (None, False, argparse.SUPPRESS):
                assert f"(default: {action.default})" in text, (name, action.dest)


def test_laneway_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert all(name.split()[0] in text for name in _commands())
    assert "COMMAND --help" in text


def test_tiny_model_and_engine_bench_show_defaults() -> None:
    assert "seed of the random weights (default: 0)" in _help("make-tiny-model")
    text = _help("bench-engine")
    assert "prompt length of the time-to-first-token runs (default: 2000)" in text
    assert "(default: 1, 8, 32)" in text
