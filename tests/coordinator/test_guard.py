"""Trend divergence guard (reference §4.9.5, §7.6)."""

from __future__ import annotations

from flodl_bus.coordinator.guard import TrendGuard, VerdictKind, max_relative_delta


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
