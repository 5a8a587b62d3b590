from __future__ import annotations

from services.planner.capacity import CapacityPlanner, CapacitySettings, Observation


def obs(
    ttft: float | None,
    itl: float | None,
    p: int = 2,
    d: int = 6,
    queue: int = 0,
    remote: float | None = None,
    local: float | None = None,
    stalled: float = 0.2,
) -> Observation:
    """By default the slow first tokens, if any, are the remotely prefilled ones, and a fifth of
    the token gaps wait on prefills."""
    if remote is None and local is None and ttft is not None:
        remote, local = ttft, ttft / 2
    return Observation(ttft, itl, queue, p, d, remote, local, stalled)


def test_slow_remote_first_tokens_move_a_decoder_to_prefill_a_step_each_look() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    first = planner.decide(obs(2000, 15))
    assert (first.move, first.workers) == ("to_prefill", 1)
    # It helped, and first tokens are still slow: onward, at the next look.
    assert planner.decide(obs(1500, 15, p=3, d=5)).move == "to_prefill"


def test_a_cooldown_after_each_move_when_asked_for() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, cooldown_intervals=1)
    )
    assert planner.decide(obs(2000, 15)).move == "to_prefill"
    assert planner.decide(obs(2000, 15, p=3, d=5)).move is None  # cooling down
    assert planner.decide(obs(1500, 15, p=3, d=5)).move == "to_prefill"


def test_a_latency_that_rose_within_the_hysteresis_after_its_move_keeps_the_move() -> None:
    """4P+4D on Mooncake: a prefill worker went to decode for ITL 1.42× its target, and the
    load grew as it moved: 1.55× at the next look. More decoders never slow tokens; the loop
    takes the next step instead of undoing it (which held 4P+4D for five minutes)."""
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(900, 28.4, p=4, d=4)).move == "to_decode"
    onward = planner.decide(obs(900, 31, p=3, d=5))
    assert onward.move == "to_decode" and "undoes" not in onward.reason


def test_a_move_that_did_not_help_is_undone_and_not_retried_for_a_while() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, futile_intervals=3)
    )
    assert planner.decide(obs(900, 30, p=0, d=8)).move == "to_prefill"  # split for ITL
    undo = planner.decide(obs(900, 34, p=1, d=7))  # tokens slower, past the hysteresis
    assert undo.move == "to_decode" and "after the last move" in undo.reason
    # Aggregated again with slow tokens: the split waits out its probation.
    assert planner.decide(obs(900, 30, p=0, d=8)).move is None
    assert "did not help" in planner.decide(obs(900, 30, p=0, d=8)).reason
    assert planner.decide(obs(900, 30, p=0, d=8)).move == "to_prefill"
    # This time it helps: it stays, and nothing else is over its target.
    assert planner.decide(obs(900, 21, p=1, d=7)).move is None


def test_a_step_back_toward_aggregated_that_loses_a_target_is_undone() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(800, 15, p=1, d=7)).move == "to_decode"
    undo = planner.decide(obs(1500, 15, p=0, d=8))
    assert undo.move == "to_prefill" and "lost a target" in undo.reason
    # Back at one prefill worker and within targets: it stays there.
    assert planner.decide(obs(800, 15, p=1, d=7)).move is None


def test_slow_local_first_tokens_grow_the_decode_pool() -> None:
    """The decode pool's own prefills are the slow ones: a prefill worker helps it by decoding."""
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    decision = planner.decide(obs(2000, 15, remote=600, local=2000))
    assert decision.move == "to_decode" and "decode pool" in decision.reason
    # Nothing prefilled remotely in the interval: the same.
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(2000, 15, remote=None, local=2000)).move == "to_decode"


def test_slow_tokens_move_a_prefiller_to_decode() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(500, 30)).move == "to_decode"


def test_hysteresis_keeps_it_still_just_under_the_targets() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(950, 19)).move is None
    assert planner.decide(obs(None, None)).move is None


def test_a_target_is_a_ceiling_just_past_it_the_loop_acts() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(1030, 19)).move == "to_prefill"
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(950, 20.6)).move == "to_decode"


def test_within_targets_prefill_workers_go_back_down_to_aggregated() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    decision = planner.decide(obs(900, 18, p=1, d=7))
    assert (decision.move, decision.workers) == ("to_decode", 1)
    assert "within targets" in decision.reason
    # Aggregated and within targets, or missing only TTFT, which no split adds capacity for.
    assert planner.decide(obs(900, 18, p=0, d=8)).move is None
    assert planner.decide(obs(5000, 18, p=0, d=8)).move is None
    # Slow tokens, but hardly any gap waited on a prefill: slow decode steps, which a split
    # would only make slower.
    calm = planner.decide(obs(900, 40, p=0, d=8, stalled=0.01))
    assert calm.move is None and "1.0% of gaps wait on prefills" in calm.reason
    # Tokens slowed by prefills interleaved with decodes: split.
    assert planner.decide(obs(900, 40, p=0, d=8)).move == "to_prefill"


def test_never_empties_the_decode_pool_and_moves_at_most_a_tenth() -> None:
    planner = CapacityPlanner(CapacitySettings())
    assert planner.decide(obs(5000, 1, p=7, d=1)).move is None
    assert planner.decide(obs(1, 500, p=0, d=1)).move is None
    assert planner.decide(obs(1, 500, p=1, d=7)).move == "to_decode"  # the last prefill worker
    big = planner.decide(obs(5000, 1, p=10, d=30))
    assert (big.move, big.workers) == ("to_prefill", 4)


def test_a_growing_prefill_queue_acts_before_latencies_show_it() -> None:
    planner = CapacityPlanner(CapacitySettings())
    # Near the targets (neither over nor comfortably under), and then a burst comes.
    assert planner.decide(obs(950, 24, queue=0)).move is None
    decision = planner.decide(obs(950, 24, queue=10_000_000))
    assert decision.move == "to_prefill"
    assert "burst" in decision.reason


def test_a_prefill_queue_growing_behind_slow_decoders_is_no_burst() -> None:
    """First tokens are already slow, and the locally prefilled ones the slowest: the decode
    pool is short, and the prefill queue grows for want of somewhere to hand its KV."""
    planner = CapacityPlanner(CapacitySettings())
    assert planner.decide(obs(950, 24, queue=0)).move is None
    decision = planner.decide(obs(5000, 26, queue=10_000_000, remote=800, local=5000))
    assert decision.move == "to_decode" and "burst" not in decision.reason


def test_reversals_wait_longer_each_time() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, max_cooldown_intervals=4)
    )

    def intervals_to_next_move(o: Observation) -> int:
        n = 1
        while planner.decide(o).move is None:
            n += 1
        return n

    # Each move cures what it was for and the other latency shows up slow instead.
    slow_first, slow_tokens = obs(2000, 15), obs(500, 30)
    assert planner.decide(slow_first).move == "to_prefill"
    # Each count is the wait the previous move set, plus the interval that moves.
    assert intervals_to_next_move(slow_tokens) == 1  # none after a move onward; this waits 1
    assert intervals_to_next_move(slow_first) == 2  # 1; doubles it to 2
    assert intervals_to_next_move(slow_tokens) == 3  # 2; doubles again to 4, the cap
    assert intervals_to_next_move(slow_first) == 5  # 4
    assert intervals_to_next_move(slow_tokens) == 5  # still 4


def test_a_move_that_fails_again_waits_twice_as_long() -> None:
    planner = CapacityPlanner(
        CapacitySettings(
            ttft_target_ms=1000, itl_target_ms=20, futile_intervals=2, max_cooldown_intervals=1
        )
    )
    slow_aggregated, slower_split = obs(900, 30, p=0, d=8), obs(900, 34, p=1, d=7)

    def looks_to_move(o: Observation) -> int:
        n = 1
        while planner.decide(o).move is None:
            n += 1
        return n

    def fail_once() -> int:
        """Looks from undoing the split to trying it again (an undo waits one look)."""
        looks_to_move(slower_split)
        return looks_to_move(slow_aggregated)

    assert planner.decide(slow_aggregated).move == "to_prefill"
    assert fail_once() == 2
    assert fail_once() == 4
    assert fail_once() == 8


def test_deep_overload_judges_a_move_by_its_direction_not_one_interval() -> None:
    """Seven prefill workers and one decoder: tokens are 8× too slow and the backlog keeps
    growing for a while whatever the loop does; it keeps adding decoders."""
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    for p in (7, 6, 5):
        decision = planner.decide(obs(900, 170, p=p, d=8 - p))
        assert decision.move == "to_decode", decision.reason


def test_with_no_worker_decoding_one_goes_back_at_once_even_while_cooling_down() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, cooldown_intervals=1)
    )
    assert planner.decide(obs(2000, 15)).move == "to_prefill"  # and it cools down now
    # The decoders that were left died: nothing finishes, so no latency either.
    back = planner.decide(obs(None, None, p=3, d=0))
    assert (back.move, back.workers) == ("to_decode", 1)
    assert back.reason.startswith("no worker decodes")


def test_it_says_which_target_no_move_can_meet_and_holds_that_while_cooling_down() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, cooldown_intervals=1)
    )
    # Aggregated, first tokens slow: every worker prefills already.
    slow_first = planner.decide(obs(2000, 15, p=0, d=8))
    assert slow_first.move is None and slow_first.out_of_reach == ("ttft",)
    assert "every worker prefills already" in slow_first.reason
    # Aggregated, tokens slow, but no prefill stalls them: decode steps alone.
    decode_bound = planner.decide(obs(900, 30, p=0, d=8, stalled=0.01))
    assert decode_bound.move is None and decode_bound.out_of_reach == ("itl",)
    # Too few workers to split off a prefill pool.
    assert planner.decide(obs(900, 30, p=0, d=1)).out_of_reach == ("itl",)
    # Split, remote first tokens slow, no decoder to spare.
    spare = planner.decide(obs(2000, 15, p=1, d=1))
    assert spare.out_of_reach == ("ttft",) and "no decode worker to spare" in spare.reason
    # A move it can still make: nothing is out of reach, and while it cools down after the
    # move that stays so; within targets, nothing is.
    moved = planner.decide(obs(2000, 15, p=2, d=6))
    assert moved.move == "to_prefill" and moved.out_of_reach == ()
    assert planner.decide(obs(2000, 15, p=3, d=5)).out_of_reach == ()
    assert planner.decide(obs(800, 15, p=3, d=5)).out_of_reach == ()


def test_an_interval_in_which_nothing_finished_tells_nothing_new() -> None:
    planner = CapacityPlanner(CapacitySettings(ttft_target_ms=1000, itl_target_ms=20))
    assert planner.decide(obs(2000, 15, p=0, d=8)).out_of_reach == ("ttft",)
    assert planner.decide(obs(None, None, p=0, d=8)).out_of_reach == ("ttft",)
    assert planner.decide(obs(800, 15, p=0, d=8)).out_of_reach == ()


def test_a_futile_move_leaves_its_target_out_of_reach_until_it_may_be_tried_again() -> None:
    planner = CapacityPlanner(
        CapacitySettings(ttft_target_ms=1000, itl_target_ms=20, futile_intervals=3)
    )
    assert planner.decide(obs(900, 30, p=0, d=8)).move == "to_prefill"
    assert planner.decide(obs(900, 34, p=1, d=7)).move == "to_decode"  # undone
    assert planner.decide(obs(900, 30, p=0, d=8)).reason == "cooling down after the last move"
    waiting = planner.decide(obs(900, 30, p=0, d=8))  # the split may not be tried yet
    assert "did not help" in waiting.reason and waiting.out_of_reach == ("itl",)
    assert planner.decide(obs(900, 30, p=0, d=8)).move == "to_prefill"
