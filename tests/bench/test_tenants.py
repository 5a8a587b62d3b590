"""`laneway bench --tenants N`: a trace's conversations dealt out to tenants whose requests are
salted as the API's keys salt them (the same functions), so that the offline replay measures what
per-tenant caches cost; and that cost on the Mooncake trace, behind ``-m slow``."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bus.api_keys import ApiKeyRecord
from infra.bench.offline import OfflineReplay
from infra.bench.trace_draws import tenant_secret, with_tenants
from infra.bench.traces import PromptFactory, load_trace
from infra.cli import main
from services.engine.sim import SimConfig
from services.planner.policy_registry import make_policy


@pytest.fixture
def system_prompt_trace(tmp_path: Path) -> Path:
    """Six conversations of three turns, each turn extending the last, all after one shared
    system-prompt block (block 0), as the Mooncake trace's are."""
    rng = random.Random(2)
    rows: list[dict[str, Any]] = []
    next_id = 1
    for conv in range(6):
        ids = [0]
        for turn in range(3):
            ids += range(next_id, next_id + 2)
            next_id += 2
            rows.append(
                {
                    "timestamp": conv * 500 + turn * 4000,
                    "input_length": len(ids) * 512 - rng.randint(0, 100),
                    "output_length": rng.randint(5, 20),
                    "hash_ids": list(ids),
                }
            )
    rows.sort(key=lambda r: r["timestamp"])
    path = tmp_path / "system.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_conversations_stay_with_one_tenant_salted_as_its_key_would_salt_them(
    system_prompt_trace: Path,
) -> None:
    trace = with_tenants(load_trace(system_prompt_trace), 2)
    by_conversation: dict[tuple[int, ...], set[str | None]] = {}
    for r in trace:
        by_conversation.setdefault(r.hash_ids[:2], set()).add(r.cache_salt)
    assert all(len(salts) == 1 for salts in by_conversation.values())
    salts = {s for found in by_conversation.values() for s in found}
    assert len(salts) == 2 and None not in salts
    # The first conversation's tenant, tenant-0, salted as the ingress salts the requests of
    # a key whose cache group has the bench's secret: the live path's functions.
    record = ApiKeyRecord(
        key_id="0" * 16, tenant="tenant-0", sha256="0" * 64, cache_secret=tenant_secret(0).hex()
    )
    assert trace[0].cache_salt == record.cache_salt()
    # The same prompt under another tenant's salt shares no block with it.
    prompts = PromptFactory(64)
    other = next(r.cache_salt for r in trace if r.cache_salt != trace[0].cache_salt)
    moved = replace(trace[0], cache_salt=other)
    assert set(prompts.block_hashes(trace[0])).isdisjoint(prompts.block_hashes(moved))


def hit_rate(trace_path: Path, tenants: int | None, workers: int = 1) -> float:
    trace = load_trace(trace_path)
    if tenants is not None:
        trace = with_tenants(trace, tenants)
    config = SimConfig(block_size=64, num_gpu_blocks=4096)
    report = OfflineReplay(trace, make_policy("kv", 0), workers, config).run().report
    return float(report["prefix_hit_rate"])


def test_tenants_lose_only_what_they_shared_with_each_other(system_prompt_trace: Path) -> None:
    shared = hit_rate(system_prompt_trace, None)
    # One tenant is one cache: salted, it hits exactly as the unsalted run does.
    assert hit_rate(system_prompt_trace, 1) == shared
    # Three tenants: each conversation's first turn no longer finds the system prompt that
    # another tenant's conversation cached; later turns still find their own history.
    apart = hit_rate(system_prompt_trace, 3)
    assert 0 < apart < shared


def test_bench_command_takes_tenants(system_prompt_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--trace", str(system_prompt_trace), "--policy", "kv", "--workers", "1"]
    assert main([*args, "--block-size", "64", "--tenants", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["kv"]
    assert report["prefix_hit_rate"] == pytest.approx(hit_rate(system_prompt_trace, 3))


def mooncake_report(trace: Path, tmp_path: Path, *flags: str) -> dict[str, Any]:
    """The README's command: policy kv, 8 workers, the trace's 512-token blocks."""
    out = tmp_path / "bench.json"
    args = ["bench", "--trace", str(trace), "--policy", "kv", "--workers", "8"]
    args += ["--block-size", "512", "--num-gpu-blocks", "2048", "--json", str(out), *flags]
    assert main(args) == 0
    report: dict[str, Any] = json.loads(out.read_text())["kv"]
    return report


@pytest.mark.slow
def test_mooncake_per_tenant_caches_cost_little_hit_rate(
    mooncake_trace: Path, tmp_path: Path
) -> None:
    """The figures of docs/security.md (tenants' prefix caches), with their command."""
    shared = mooncake_report(mooncake_trace, tmp_path)
    # One tenant: salted, and every decision the same as unsalted.
    one = mooncake_report(mooncake_trace, tmp_path, "--tenants", "1")
    assert one["prefix_hit_rate"] == shared["prefix_hit_rate"]
    for tenants in (2, 8):
        apart = mooncake_report(mooncake_trace, tmp_path, "--tenants", str(tenants))
        print(
            f"tenants {tenants}: hit rate {apart['prefix_hit_rate']:.4f} "
            f"(shared {shared['prefix_hit_rate']:.4f}), TTFT p95 {apart['ttft_ms']['p95']:.1f} "
            f"(shared {shared['ttft_ms']['p95']:.1f})"
        )
        # Conversations share only the system prompt's block across tenants, which every
        # worker soon holds for each tenant: within a point of the shared cache's hit rate.
        assert abs(apart["prefix_hit_rate"] - shared["prefix_hit_rate"]) < 0.01
