"""A decode run does what stepping one step at a time does: the same tokens at the same times,
the same KV changes in the same order, the same engine left behind. Randomized workloads under a
tight KV pool (evictions, preemptions, a host tier) and arrivals cutting runs short."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest, KvChange
from services.engine.sim import SimConfig, SimEngine


@dataclass
class Trail:
    """What a consumer of the engine saw: tokens with their times, KV changes with the time
    they were published, and step intervals."""

    tokens: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    # A run's changes of steps before its last are published at once (None: no time).
    changes: list[tuple[float | None, KvChange]] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    runs: int = 0


def _engine(host_blocks: int) -> SimEngine:
    config = SimConfig(
        block_size=4,
        num_gpu_blocks=48,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        num_host_blocks=host_blocks,
    )
    return SimEngine(config)


def _workload(seed: int) -> list[tuple[float, EngineRequest]]:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(256) for _ in range(rng.randint(0, 12))) for _ in range(4)]
    arrivals, now = [], 0.0
    for i in range(60):
        now += rng.expovariate(1 / 0.15)
        prompt = rng.choice(prefixes) + tuple(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        sampling = SamplingParams(max_tokens=rng.randint(1, 60), ignore_eos=True)
        arrivals.append((now, EngineRequest(f"r{i}", prompt, sampling)))
    return arrivals


def _drive(engine: SimEngine, arrivals: list[tuple[float, EngineRequest]], runs: bool) -> Trail:
    """One worker's event loop: arrivals join when they come; a step's outputs and KV changes
    count when it ends. With ``runs``, decode runs stop before the next arrival."""
    trail = Trail()
    queue = list(arrivals)
    now = 0.0
    while queue or engine.has_work():
        until = queue[0][0] if queue else float("inf")
        if not engine.has_work():
            now = until
        while queue and queue[0][0] <= now:
            engine.add_request(queue.pop(0)[1])
        run = engine.decode_run(now, until) if runs else None
        if run is not None:
            trail.runs += 1
            trail.steps += zip(run.times, run.times[1:], strict=False)
            end = run.times[-1]
            trail.changes += [(None, c) for c in run.ended_changes]
            trail.changes += [(end, c) for c in run.last_changes]
            steps = len(run.times) - 1
            for req in run.requests:
                tokens = req.output[len(req.output) - steps :]
                got = trail.tokens.setdefault(req.request_id, [])
                got += zip(run.times[1:], tokens, strict=True)
            now = end
            continue
        result = engine.step()
        end = now + result.duration_s
        if result.duration_s > 0:
            trail.steps.append((now, end))
        trail.changes += [(end, c) for c in result.kv_changes]
        for out in result.outputs:
            trail.tokens.setdefault(out.request_id, []).append((end, out.new_token_ids[0]))
        now = end if result.duration_s > 0 else until
    return trail


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("host_blocks", [0, 24])
def test_a_decode_run_is_its_steps_one_by_one(seed: int, host_blocks: int) -> None:
    arrivals = _workload(seed)
    stepped = _drive(_engine(host_blocks), arrivals, runs=False)
    ran = _drive(_engine(host_blocks), arrivals, runs=True)
    assert ran.runs > 0
    assert ran.tokens == stepped.tokens
    assert ran.steps == stepped.steps
    assert [c for _, c in ran.changes] == [c for _, c in stepped.changes]
    # Its last step's changes are published when that step ends, as a step's are.
    assert all(r in (None, s) for (r, _), (s, _) in zip(ran.changes, stepped.changes, strict=True))


def test_a_run_stops_at_a_waiting_request_and_is_none_when_the_next_step_is_not_plain() -> None:
    engine = _engine(0)
    prompt = tuple(range(10))
    engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    assert engine.decode_run(0.0, 1.0) is None  # the prompt is still to prefill
    first = engine.step()
    run = engine.decode_run(first.duration_s, float("inf"))
    assert run is not None and len(run.times) > 2
    engine.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert engine.decode_run(run.times[-1], float("inf")) is None
