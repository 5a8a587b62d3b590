from __future__ import annotations

from services.planner.capacity import CapacityPlanner, CapacitySettings, Observation


def obs(
    ttft: float | None, itl: float | None, p: int = 2, d: int = 6, queue: int = 0
) -> Observation:
    return Observation(ttft, itl, queue, p, d)


def test_slow_first_tokens_move_a_decoder_to_prefill_then_cool_down() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    first = planner.decide(obs(2000, 15))
    assert (first.move, first.workers) == ("to_prefill", 1)
    assert planner.decide(obs(2000, 15)).move is None  # cooling down
    assert planner.decide(obs(2000, 15)).move == "to_prefill"


def test_slow_tokens_move_a_prefiller_to_decode() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(500, 30)).move == "to_decode"


def test_hysteresis_keeps_it_still_near_the_targets() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(1050, 21)).move is None
    assert planner.decide(obs(None, None)).move is None


def test_never_empties_a_pool_and_moves_at_most_a_tenth() -> None:
    planner = CapacityPlanner(CapacitySettings(cooldown_intervals=0))
    assert planner.decide(obs(5000, 1, p=7, d=1)).move is None
    assert planner.decide(obs(1, 500, p=1, d=7)).move is None
    # An aggregated pool is split when first tokens are slow.
    assert planner.decide(obs(5000, 1, p=0, d=8)).move == "to_prefill"
    big = planner.decide(obs(5000, 1, p=10, d=30))
    assert (big.move, big.workers) == ("to_prefill", 4)


def test_a_growing_prefill_queue_acts_before_latencies_show_it() -> None:
    planner = CapacityPlanner(CapacitySettings(cooldown_intervals=0))
    assert planner.decide(obs(100, 5, queue=0)).move is None
    decision = planner.decide(obs(100, 5, queue=10_000_000))
    assert decision.move == "to_prefill"
    assert "burst" in decision.reason


def test_undoing_the_last_move_waits_longer_each_time() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, max_cooldown_intervals=4)
    )

    def intervals_to_next_move(o: Observation) -> int:
        n = 1
        while planner.decide(o).move is None:
            n += 1
        return n

    slow_first, slow_tokens = obs(2000, 15), obs(500, 30)
    assert planner.decide(slow_first).move == "to_prefill"
    # Each count is the wait the previous move set, plus the interval that moves.
    assert intervals_to_next_move(slow_first) == 2  # onward; the wait stays 1
    assert intervals_to_next_move(slow_tokens) == 2  # a reversal; the wait doubles to 2
    assert intervals_to_next_move(slow_first) == 3  # another; 4, the cap
    assert intervals_to_next_move(slow_tokens) == 5  # another; still 4
    assert intervals_to_next_move(slow_tokens) == 5  # onward; back to 1
    assert intervals_to_next_move(slow_tokens) == 2
