"""ElChe cadence cases (reference §7.7, newest rules of §4.9)."""

from __future__ import annotations

from flodl_bus.coordinator.elche import ElChe, WindowReport, slowest_by_spec
from flodl_bus.coordinator.guard import STABLE, SUPPRESS, Verdict, VerdictKind


def report(
    *ms: float | None, reduce_ms: float = 0.0, fill_ms: tuple[float, ...] = ()
) -> WindowReport:
    return WindowReport(tuple(ms), reduce_ms=reduce_ms, fill_ms=fill_ms)


def test_cadence_initial_equal() -> None:
    assert ElChe(2).counts == [10, 10]


def test_cadence_initial_three_devices() -> None:
    assert ElChe(3, anchor=15).counts == [15, 15, 15]


def test_cadence_ratio_discovery_2x() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [20, 10]
    assert el.calibrated and el.phase == "warmup"


def test_cadence_ratio_discovery_fbrl_like() -> None:
    el = ElChe(2)
    el.report_window(report(73.0, 164.0))
    assert el.counts[1] == 10
    assert el.counts[0] in (22, 23)


def test_cadence_three_devices_mixed_speed() -> None:
    el = ElChe(3)
    el.report_window(report(10.0, 15.0, 30.0))
    assert el.counts == [30, 20, 10]


def test_a_dead_anchor_rank_hands_the_anchor_to_the_slowest_live_rank() -> None:
    el = ElChe(3)
    el.report_window(report(10.0, 10.0, 40.0))
    assert el.anchor_rank == 2 and el.counts == [40, 40, 10]
    el.forget(2)  # rank 2 died: its 40 ms no longer sets the pace
    assert el.anchor_rank in (0, 1)
    assert el.counts[:2] == [10, 10]
    el.report_window(report(10.0, 10.0, None))  # the dead rank reports nothing more
    assert el.anchor_rank in (0, 1) and el.counts[:2] == [10, 10]


def test_speed_ratio_is_capped_at_64() -> None:
    el = ElChe(2)
    el.report_window(report(0.001, 1000.0))
    assert el.counts == [640, 10]


def test_cadence_anchor_auto_tune_grows_by_at_most_the_step_cap() -> None:
    # overhead = 100 / (10 x 10 + 100) = 0.5, five times the 0.1 target.
    el = ElChe(2, overhead_target=0.1)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    assert el.pending_anchor is None  # warm-up: never on the first calibration
    el.apply_verdict(STABLE)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    assert el.pending_anchor == 20  # x min(5, 2)
    assert el.anchor == 10  # only proposed
    el.apply_verdict(STABLE)
    assert el.anchor == 20
    assert el.counts == [20, 20]


def test_cadence_anchor_capped_at_max() -> None:
    el = ElChe(2, overhead_target=0.1, max_anchor=15)
    for _ in range(3):
        el.report_window(report(10.0, 10.0, reduce_ms=100.0))
        el.apply_verdict(STABLE)
    assert el.anchor == 15


def test_cadence_stable_when_overhead_low() -> None:
    el = ElChe(2, overhead_target=0.1)
    for _ in range(4):
        el.report_window(report(10.0, 10.0, reduce_ms=1.0))
        el.apply_verdict(STABLE)
    assert el.anchor == 10


def test_guard_veto_discards_the_growth_proposal() -> None:
    el = ElChe(2, overhead_target=0.1)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    el.apply_verdict(STABLE)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    assert el.pending_anchor == 20
    el.apply_verdict(SUPPRESS)
    assert el.anchor == 10
    assert el.pending_anchor is None


def test_nudge_down_discards_the_proposal_and_shrinks() -> None:
    el = ElChe(2, anchor=20, overhead_target=0.1)
    el.report_window(report(10.0, 10.0, reduce_ms=400.0))
    el.apply_verdict(STABLE)
    el.report_window(report(10.0, 10.0, reduce_ms=400.0))
    assert el.pending_anchor == 40
    el.apply_verdict(Verdict(VerdictKind.NUDGE_DOWN, 0.5))
    assert el.anchor == 10


def test_nudge_anchor_down() -> None:
    el = ElChe(2, anchor=20)
    el.report_window(report(10.0, 10.0))
    el.nudge_anchor_down(0.5)
    assert el.anchor == 10
    assert el.counts == [10, 10]


def test_nudge_before_any_measurement_shrinks_the_anchor_and_keeps_the_counts() -> None:
    el = ElChe(2, anchor=20, speed_hints=(2.0, 1.0))
    el.nudge_anchor_down(0.5)
    assert el.anchor == 10 and el.counts == [40, 20]


def test_a_nan_nudge_factor_changes_nothing() -> None:
    el = ElChe(2, anchor=20)
    el.nudge_anchor_down(float("nan"))
    assert el.anchor == 20


def test_nudge_anchor_down_clamped_to_one() -> None:
    el = ElChe(2, anchor=1)
    el.nudge_anchor_down(0.01)
    assert el.anchor == 1


def test_nudge_anchor_down_never_increases() -> None:
    el = ElChe(2, anchor=10)
    el.nudge_anchor_down(3.0)
    assert el.anchor == 10


def test_batch_count_clamped_to_max_diff_after_the_calibration_pass() -> None:
    el = ElChe(2, max_batch_diff=5)
    el.report_window(report(10.0, 50.0))
    assert el.counts == [50, 10]  # the calibration pass is not clamped
    el.report_window(report(1.0, 50.0))  # ring mean 5.5 ms -> target 91
    assert el.counts == [55, 10]


def test_dead_zone_keeps_counts_within_five_percent() -> None:
    el = ElChe(2, anchor=100)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [200, 100]
    el.report_window(report(10.4, 20.0))  # ring mean 10.2 -> target 196: -2 %, kept
    assert el.counts == [200, 100]
    el.report_window(report(12.0, 20.0))  # ring mean 10.8 -> target 185: -7.5 %, taken
    assert el.counts == [185, 100]


def test_window_cap_scales_counts_down_and_blocks_growth() -> None:
    el = ElChe(2, window_cap=12, overhead_target=0.1)
    el.report_window(report(10.0, 50.0, reduce_ms=1000.0))
    assert sum(el.counts) == 12
    assert el.counts[0] > el.counts[1] >= 1
    assert el.window_cap_binding
    el.apply_verdict(STABLE)
    el.report_window(report(10.0, 50.0, reduce_ms=1000.0))
    assert el.pending_anchor is None


def test_cadence_clamp_total_keeps_order() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    assert el.clamp_total(15) == [10, 5]
    assert el.clamp_total(100) == [20, 10]


def test_fastest_skips_dead_and_uncalibrated_ranks() -> None:
    el = ElChe(3)
    assert el.fastest([True, True, True]) is None
    el.report_window(report(5.0, 3.0, 9.0))
    assert el.fastest([True, True, True]) == 1
    assert el.fastest([True, False, True]) == 0


def test_state_round_trips() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    other = ElChe(2)
    other.restore(el.state())
    assert other.counts == el.counts
    assert other.smoothed_ms(0) == el.smoothed_ms(0)
    assert other.calibrated


# ------------------------------------------------------------------ speed hints, slack
def test_cadence_speed_ratio_2x() -> None:
    assert ElChe(2, speed_hints=(2.0, 1.0)).counts == [20, 10]


def test_cadence_speed_ratio_three_devices_mid_slow() -> None:
    assert ElChe(3, speed_hints=(3.0, 1.0, 2.0)).counts == [30, 10, 20]


def test_cadence_speed_ratio_self_corrects() -> None:
    el = ElChe(2, speed_hints=(4.0, 1.0))
    el.report_window(report(10.0, 10.0))
    assert el.counts == [10, 10]


def test_callback_slack_shortens_the_callback_ranks_window_for_one_report() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [20, 10]
    el.stage_slack([55.0, 0.0])  # ceil(55 / 10) = 6 batches off rank 0
    el.report_window(report(10.0, 20.0))
    assert el.counts == [14, 10]
    el.report_window(report(10.0, 20.0))
    assert el.counts == [20, 10]


def test_callback_slack_survives_a_growth_commit_in_the_same_finish() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    el.report_window(report(10.0, 20.0))
    el.stage_slack([55.0, 0.0])
    el.report_window(report(10.0, 20.0, reduce_ms=200.0))
    assert el.pending_anchor is not None
    el.apply_verdict(STABLE)
    assert el.counts[0] == 2 * el.anchor - 6


def test_relax_up_adds_one_batch_to_the_anchor_on_a_stable_verdict() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [20, 10]
    el.apply_verdict(STABLE, relax_up=True)
    assert el.anchor == 11 and el.counts == [22, 11]


def test_relax_up_needs_the_flag_and_a_stable_verdict() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 10.0))
    el.apply_verdict(STABLE)
    assert el.anchor == 10
    el.apply_verdict(SUPPRESS, relax_up=True)
    assert el.anchor == 10
    el.apply_verdict(Verdict(VerdictKind.NUDGE_DOWN, 0.5), relax_up=True)
    assert el.anchor == 5


def test_relax_up_follows_a_committed_growth_proposal() -> None:
    el = ElChe(2, overhead_target=0.1)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    el.apply_verdict(STABLE)
    el.report_window(report(10.0, 10.0, reduce_ms=100.0))
    assert el.pending_anchor == 20
    el.apply_verdict(STABLE, relax_up=True)
    assert el.anchor == 21


def test_relax_up_stops_at_max_anchor() -> None:
    el = ElChe(2, anchor=10, max_anchor=11)
    el.report_window(report(10.0, 10.0))
    for _ in range(3):
        el.apply_verdict(STABLE, relax_up=True)
    assert el.anchor == 11


def test_relax_up_refuses_a_step_that_would_put_the_fast_rank_past_max_batch_diff() -> None:
    # Speed ratio 3 and max_batch_diff 100: the anchor stops at 50 ([50, 150], diff 100).
    el = ElChe(2, anchor=48, max_batch_diff=100)
    el.report_window(report(10.0, 30.0))
    for _ in range(5):
        el.apply_verdict(STABLE, relax_up=True)
    assert el.anchor == 50
    free = ElChe(2, anchor=48)
    free.report_window(report(10.0, 30.0))
    for _ in range(5):
        free.apply_verdict(STABLE, relax_up=True)
    assert free.anchor == 53


def test_relax_up_before_any_measurement_keeps_the_hinted_counts() -> None:
    el = ElChe(2, speed_hints=(2.0, 1.0))
    assert el.counts == [20, 10]
    el.apply_verdict(STABLE, relax_up=True)
    assert el.anchor == 11 and el.counts == [20, 10]


def test_dead_zone_keeps_a_count_whose_change_is_exactly_five_percent() -> None:
    el = ElChe(2, anchor=20)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [40, 20]
    el.report_window(report(2 * 400 / 42 - 10, 20.0))  # rank 0 mean 400/42: target 42
    assert el.counts == [40, 20]  # 2 of 40 is not more than 5 %
    # records made before this rule replay with the old boundary (it moved at 5 %)
    old = ElChe(2, anchor=20, dead_zone_keeps_five_percent=False)
    old.report_window(report(10.0, 20.0))
    old.report_window(report(2 * 400 / 42 - 10, 20.0))
    assert old.counts == [42, 20]


def test_a_slack_shortened_window_still_moves_by_at_most_max_batch_diff() -> None:
    el = ElChe(2, max_batch_diff=2)
    el.report_window(report(10.0, 20.0))
    assert el.counts == [20, 10]
    el.stage_slack([100.0, 0.0])  # 10 batches of rank 0's time
    el.report_window(report(10.0, 20.0))
    assert el.counts == [18, 10]


def test_stable_growth_threshold_applies_from_the_sixth_calibration() -> None:
    # overhead 17.6 / (10 x 10 + 17.6) ~ 0.15: above the 0.1 target, under warm-up's 0.2
    el = ElChe(2, overhead_target=0.1)
    for _ in range(5):
        el.report_window(report(10.0, 10.0, reduce_ms=17.6))
        assert el.pending_anchor is None
        el.apply_verdict(STABLE)
    el.report_window(report(10.0, 10.0, reduce_ms=17.6))
    assert el.phase == "stable" and el.pending_anchor == 15


def test_anchor_rank_re_election_waits_for_the_sixth_calibration() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    assert el.anchor_rank == 1
    for _ in range(4):
        el.report_window(report(40.0, 20.0))  # rank 0 turned slow
    assert el.anchor_rank == 1  # the fifth report still starts in warm-up
    el.report_window(report(40.0, 20.0))
    assert el.anchor_rank == 0


def test_a_min_anchor_above_the_initial_anchor_lifts_it_and_max_anchor_caps_both() -> None:
    el = ElChe(2, anchor=10, min_anchor=20)
    assert el.anchor == 20 and el.min_anchor == 20 and el.counts == [20, 20]
    capped = ElChe(2, anchor=10, min_anchor=30, max_anchor=25)
    assert capped.anchor == 25 and capped.min_anchor == 25
    low = ElChe(2, anchor=10, min_anchor=4)
    assert low.anchor == 10 and low.min_anchor == 4


def test_growth_is_judged_against_the_window_cap_the_closed_window_ran_under() -> None:
    el = ElChe(2, anchor=10, overhead_target=0.1, window_cap=25)
    el.report_window(report(10.0, 10.0))
    assert el.counts == [10, 10] and not el.window_cap_binding
    # rank 1 turns out twice as fast: its count doubles past the cap (binding from now)
    el.report_window(report(20.0, 5.0, reduce_ms=150.0))
    assert el.window_cap_binding and sum(el.counts) == 25
    assert el.pending_anchor == 20  # the window that just closed was not capped
    el.report_window(report(15.0, 7.5, reduce_ms=150.0))
    assert el.pending_anchor is None  # this one was


def test_growth_counts_the_anchor_ranks_fill_not_a_faster_ranks() -> None:
    el = ElChe(2, anchor=10, overhead_target=0.1)
    el.report_window(report(10.0, 20.0))
    assert el.anchor_rank == 1
    # the fast rank's 200 ms first batch (say, its loader starting) grows nothing
    el.report_window(report(10.0, 20.0, fill_ms=(200.0, 0.0)))
    assert el.pending_anchor is None
    # the slowest rank's does: 100 / (10 x 20 + 100) = 1/3, over warm-up's 0.2
    el.report_window(report(10.0, 20.0, fill_ms=(0.0, 100.0)))
    assert el.pending_anchor == 20


def _stable(el: ElChe, *ms: float) -> None:
    """Calibrate into the Stable phase on equal readings."""
    for _ in range(5):
        el.report_window(report(*ms))
    assert el.phase == "stable"


def test_a_cohort_rank_slower_than_the_anchor_by_more_than_the_margin_takes_it_over() -> None:
    # flodl's elect_anchor: r0 anchors at 10 ms; r1 drifts to 11.5 ms (> 10 x 1.10)
    el = ElChe(2)
    _stable(el, 10.0, 10.0)
    assert el.anchor_rank == 0
    for _ in range(5):
        el.report_window(report(10.0, 11.5))
    assert el.anchor_rank == 1
    assert el.counts[1] == el.anchor and el.counts[0] >= el.anchor


def test_records_made_before_flodls_election_keep_the_lowest_rank_of_the_cohort() -> None:
    el = ElChe(2, flodl_election=False)
    _stable(el, 10.0, 10.0)
    for _ in range(5):
        el.report_window(report(10.0, 11.5))
    assert el.anchor_rank == 0


def test_a_challenger_within_the_dominance_margin_never_takes_the_anchor() -> None:
    el = ElChe(3)
    _stable(el, 10.0, 10.0, 5.0)
    for _ in range(10):
        el.report_window(report(10.0, 10.9, 5.0))  # 9% slower: noise, not a new anchor
    assert el.anchor_rank == 0


def test_the_slowest_of_several_challengers_is_elected_the_last_of_equals() -> None:
    el = ElChe(3)
    _stable(el, 10.0, 10.0, 10.0)
    for _ in range(5):
        el.report_window(report(10.0, 12.0, 12.0))
    assert el.anchor_rank == 2  # flodl's max_by: the last of the equally slow


def test_a_rank_silent_for_a_whole_trust_window_has_its_timing_cleared() -> None:
    el = ElChe(3)
    el.report_window(report(10.0, 20.0, 10.0))
    for _ in range(4):
        el.report_window(report(10.0, 20.0, None))
    assert el.smoothed_ms(2) == 10.0  # four empty reports: its readings still steer
    el.report_window(report(10.0, 20.0, None))
    assert el.smoothed_ms(2) is None  # the fifth: cleared, it starts afresh
    el.report_window(report(10.0, 20.0, 40.0))
    assert el.smoothed_ms(2) == 40.0


def test_a_window_without_any_reading_is_no_report() -> None:
    el = ElChe(2)
    el.report_window(report(10.0, 20.0))
    for _ in range(6):
        el.report_window(report(None, None))
    assert el.calibrations == 1 and el.smoothed_ms(0) == 10.0


def test_speed_hints_pin_the_slowest_hinted_rank_through_warm_up() -> None:
    el = ElChe(2, speed_hints=(2.0, 1.0))
    assert el.anchor_rank == 1
    el.report_window(report(20.0, 10.0))  # a cold first window on rank 0
    assert el.anchor_rank == 1 and el.counts == [5, 10]
    legacy = ElChe(2, speed_hints=(2.0, 1.0), flodl_election=False)
    legacy.report_window(report(20.0, 10.0))
    assert legacy.anchor_rank == 0


def test_the_window_caps_remainder_goes_to_the_last_of_the_largest_counts() -> None:
    # counts 20, 10, 20 under a cap of 47: floors 18, 9, 18, two batches left over
    assert ElChe(3, speed_hints=(2.0, 1.0, 2.0), window_cap=47).counts == [18, 9, 20]
    legacy = ElChe(3, speed_hints=(2.0, 1.0, 2.0), window_cap=47, flodl_election=False)
    assert legacy.counts == [20, 9, 18]


def test_the_lowest_device_spec_score_anchors_through_warm_up_then_measurements_take_over() -> None:
    # flodl's with_device_indices: an A100 80GB (880) among RTX 3090s (884) is the
    # spec-slowest, so rank 1 anchors before any timing
    el = ElChe(3, device_scores=(884.0, 880.0, 884.0))
    assert el.anchor_rank == 1 and el.counts == [10, 10, 10]
    # it is a prior only: the warm-up keeps it even though rank 1 measures fastest...
    for _ in range(5):
        el.report_window(report(10.0, 5.0, 10.0))
        assert el.anchor_rank == 1
    assert el.counts == [5, 10, 5]
    # ...and the first election of the Stable phase hands it to the measured slow cohort
    el.report_window(report(10.0, 5.0, 10.0))
    assert el.anchor_rank == 0 and el.counts == [10, 20, 10]


def test_equal_spec_scores_anchor_the_lowest_of_those_ranks() -> None:
    assert slowest_by_spec((880.0, 880.0, 884.0)) == 0
    assert slowest_by_spec((884.0, 880.0, 880.0)) == 1
    assert slowest_by_spec(()) is None
    assert ElChe(3, device_scores=(884.0, 883.5, 883.5)).anchor_rank == 1


def test_speed_hints_outrank_device_scores_and_scores_missing_a_rank_give_no_prior() -> None:
    # the user says rank 0 is slow; the spec says rank 1: the user wins
    assert ElChe(2, speed_hints=(1.0, 2.0), device_scores=(900.0, 800.0)).anchor_rank == 0
    # under the rules of records made before the pin, hints pin nothing, nor do scores
    legacy = ElChe(2, speed_hints=(1.0, 2.0), device_scores=(900.0, 800.0), flodl_election=False)
    assert legacy.anchor_rank is None
    # scores that do not cover every rank are no prior at all, as in flodl
    assert ElChe(3, device_scores=(900.0, 800.0)).anchor_rank is None
    assert ElChe(2).anchor_rank is None
