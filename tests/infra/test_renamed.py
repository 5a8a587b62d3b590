"""Renamed flags and settings keep working for a release: the old name still sets the value,
with a one-line warning naming the new one, and the new name wins where both are given."""

from __future__ import annotations

import logging

import pytest

from infra.cli import build_parser
from services.planner.main import PlannerSettings
from services.worker.settings import WorkerSettings


@pytest.mark.parametrize(
    ("argv", "old"),
    [
        (["up", "--timing", "fixed"], "--timing"),
        (["bench", "--engine-preset", "fixed"], "--engine-preset"),
        (["bench", "--timing", "fixed"], "--timing"),
    ],
)
def test_a_renamed_flag_sets_the_new_one_with_a_warning(
    argv: list[str], old: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser(argv[0]).parse_args(argv)
    assert args.perf_model == "fixed"
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == [
        f"laneway: {old} is deprecated and goes in the next release: use --perf-model"
    ]
    # The new name, and no name at all, say nothing.
    parser = build_parser(argv[0])
    assert parser.parse_args([argv[0]]).perf_model == "dynamo-mocker"
    assert parser.parse_args([argv[0], "--perf-model", "fixed"]).perf_model == "fixed"
    assert capsys.readouterr().err == ""
    # Hidden from the help: the new name is the one to learn.
    assert old not in build_parser(argv[0]).format_help()


@pytest.mark.parametrize(
    ("settings", "old"),
    [(WorkerSettings, "LANEWAY_TIMING"), (PlannerSettings, "LANEWAY_KV_PERF_MODEL")],
)
def test_a_renamed_setting_is_read_with_a_warning_and_the_new_name_wins(
    settings: type[WorkerSettings] | type[PlannerSettings],
    old: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("LANEWAY_PERF_MODEL", raising=False)
    monkeypatch.setenv(old, "fixed")
    with caplog.at_level(logging.WARNING):
        assert settings().perf_model == "fixed"
    assert [r.getMessage() for r in caplog.records] == [
        f"{old} is deprecated and goes in the next release: use LANEWAY_PERF_MODEL"
    ]
    caplog.clear()
    monkeypatch.setenv("LANEWAY_PERF_MODEL", "dynamo-mocker")
    with caplog.at_level(logging.WARNING):
        assert settings().perf_model == "dynamo-mocker"
    assert caplog.records == []
