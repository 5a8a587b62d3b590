"""`laneway bench --loras N`: each conversation of a trace asks for one of N LoRA adapters drawn by
Zipf, the simulated workers hold `--max-loras` and load others, and the kv policy, weighing the
loads, routes to where adapters are held: fewer loads and a sooner first token than without."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from infra.bench.offline import OfflineReplay
from infra.bench.trace_draws import with_loras
from infra.bench.traces import conversation, load_trace
from infra.cli import main
from services.engine.sim import SimConfig
from services.planner.kv_policy import KvSettings
from services.planner.policy_registry import make_policy


def test_a_conversation_keeps_its_adapter_and_the_first_is_asked_most(small_trace: Path) -> None:
    trace = load_trace(small_trace)
    drawn = with_loras(trace, 4, 1.1)
    assert with_loras(trace, 4, 1.1) == drawn  # the same every run
    by_conversation: dict[tuple[int, ...], set[str | None]] = {}
    for r in drawn:
        by_conversation.setdefault(conversation(r), set()).add(r.lora)
    assert all(len(loras) == 1 for loras in by_conversation.values())
    assert {r.lora for r in drawn} <= {f"lora-{k}" for k in range(4)}
    with pytest.raises(ValueError):
        with_loras(trace, 0, 1.1)


def test_zipf_draws_and_the_kv_policy_loads_fewer_adapters_sooner(mooncake_trace: Path) -> None:
    trace = with_loras(load_trace(mooncake_trace)[:1500], 12, 1.1)
    asked = Counter(r.lora for r in trace)
    assert asked.most_common(1)[0][0] == "lora-0" and len(asked) > 6
    config = SimConfig(max_loras=2, lora_load_ms=150.0)

    def replay(policy: str, lora_load_ms: float = 150.0) -> dict[str, float]:
        chosen = make_policy(policy, 0, KvSettings(lora_load_ms=lora_load_ms))
        report = OfflineReplay(trace, chosen, 8, config).run().report
        return {"ttft": report["ttft_ms"]["mean"], "loads": report["lora_loads"]}

    aware, unaware, rr = replay("kv"), replay("kv", lora_load_ms=0.0), replay("round_robin")
    assert aware["loads"] < 0.7 * unaware["loads"]
    assert aware["ttft"] < unaware["ttft"] and aware["ttft"] < 0.9 * rr["ttft"]


def test_bench_takes_loras(small_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "--trace", str(small_trace), "--workers", "2", "--policy", "kv"]
    assert main([*argv, "--loras", "3", "--max-loras", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kv"]["lora_loads"] > 0


@pytest.mark.parametrize("flag", ["--tenants", "--loras"])
def test_offline_only_flags_are_refused_live(
    flag: str, small_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--trace", str(small_trace), "--mode", "live", flag, "2"]) == 2
    assert f"{flag} is offline only" in capsys.readouterr().err
