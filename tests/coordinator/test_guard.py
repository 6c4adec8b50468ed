"""Trend divergence guard (reference §4.9.5, §7.6)."""

from __future__ import annotations

import math

from flodl_bus.coordinator.guard import (
    STABLE,
    MsfGuard,
    NoGuard,
    TrendGuard,
    VerdictKind,
    max_relative_delta,
)


def kinds(guard: TrendGuard, values: list[float]) -> list[VerdictKind]:
    return [guard.report([v, v / 2]).kind for v in values]


def test_max_relative_delta_picks_worst_rank_and_empty_is_zero() -> None:
    assert max_relative_delta([0.1, None, 0.3, 0.2]) == 0.3
    assert max_relative_delta([]) == 0.0


def test_three_rising_above_threshold_suppresses() -> None:
    g = TrendGuard(threshold=0.05)
    assert kinds(g, [0.05, 0.13, 0.23]) == [
        VerdictKind.STABLE,
        VerdictKind.STABLE,
        VerdictKind.SUPPRESS_GROWTH,
    ]


def test_single_spike_does_not_suppress() -> None:
    g = TrendGuard(threshold=0.05)
    assert VerdictKind.SUPPRESS_GROWTH not in kinds(g, [0.01, 0.5, 0.01, 0.02])


def test_rising_below_threshold_is_stable() -> None:
    g = TrendGuard(threshold=0.05)
    assert VerdictKind.SUPPRESS_GROWTH not in kinds(g, [0.01, 0.02, 0.03, 0.04])


def test_non_rising_is_stable() -> None:
    g = TrendGuard(threshold=0.05)
    assert kinds(g, [0.3, 0.2, 0.25])[-1] is VerdictKind.STABLE


def test_history_capped_at_5() -> None:
    g = TrendGuard()
    kinds(g, [0.1 * i for i in range(9)])
    assert list(g.history) == [0.1 * i for i in range(4, 9)]


def test_disabled_always_stable() -> None:
    g = TrendGuard(threshold=0.01, enabled=False)
    assert set(kinds(g, [0.1, 0.2, 0.3, 0.4])) == {VerdictKind.STABLE}


# ------------------------------------------------------------------ MsfGuard (opt-in)
def msf_kinds(values: list[float], k_max: int = 1) -> list[VerdictKind]:
    g = MsfGuard()
    return [g.report([v], k_max).kind for v in values]


def test_msf_rate_is_log_ratio_per_step_bias_corrected() -> None:
    g = MsfGuard()
    g.report([0.01], 10)
    g.report([0.02], 10)
    # one sample: the bias-corrected EMA is the sample itself
    assert g.rate is not None and math.isclose(g.rate, math.log(2) / 10)


def test_msf_flat_or_falling_divergence_is_stable() -> None:
    assert set(msf_kinds([0.05] * 8)) == {VerdictKind.STABLE}
    assert set(msf_kinds([0.05 * 0.9**i for i in range(8)])) == {VerdictKind.STABLE}


def test_msf_suppresses_after_three_windows_above_1e3_then_rebuilds_its_streak() -> None:
    # growth ~ 0.2%/step: above 1e-3, below 1e-2
    vals = [0.01 * math.exp(0.002 * i) for i in range(8)]
    S, X = VerdictKind.STABLE, VerdictKind.SUPPRESS_GROWTH
    assert msf_kinds(vals) == [S, S, S, X, S, S, X, S]


def test_msf_nudges_by_half_after_three_windows_above_1e2_then_rebuilds_its_streak() -> None:
    g = MsfGuard()
    vals = [0.01 * math.exp(0.05 * i) for i in range(8)]
    got = [g.report([v], 1) for v in vals]
    assert [v.kind for v in got[:4]] == [VerdictKind.STABLE] * 3 + [VerdictKind.NUDGE_DOWN]
    assert got[3].factor == 0.5
    # the nudge won the window both were due; the veto's own streak still fires next
    assert [v.kind for v in got[4:7]] == [
        VerdictKind.SUPPRESS_GROWTH,
        VerdictKind.STABLE,
        VerdictKind.NUDGE_DOWN,
    ]


def test_msf_zero_divergence_yields_no_rate() -> None:
    g = MsfGuard()
    assert g.report([0.0], 1) == STABLE
    assert g.report([0.0], 1) == STABLE
    assert g.rate is None


def test_msf_a_window_below_the_noise_floor_breaks_the_rate_chain() -> None:
    # 0 -> 0.01 would be ln(1e6) per step against a floored 1e-8: no such sample.
    g = MsfGuard()
    for v in (0.01, 0.0, 0.01, 0.01):
        g.report([v], 1)
    assert g.rate == 0.0


def test_msf_the_rate_holds_through_a_window_without_steps() -> None:
    g = MsfGuard()
    for v in (0.01, 0.02):
        g.report([v], 10)
    rate = g.rate
    g.report([0.04], 0)
    assert g.rate == rate


def test_msf_disabled_for_sync_never_acts() -> None:
    g = MsfGuard(enabled=False)
    assert {g.report([0.01 * math.exp(i)], 1).kind for i in range(6)} == {VerdictKind.STABLE}


def test_no_guard_is_always_stable_and_keeps_history() -> None:
    g = NoGuard()
    assert {g.report([0.01 * 2**i]).kind for i in range(6)} == {VerdictKind.STABLE}
    assert len(g.history) == 5
