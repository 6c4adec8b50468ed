"""The LR-aware meta-controller (reference §4.9.6) and how its verdict meets the guard's
and ElChe's (reference §4.6.2 step 7, §6 row 27)."""

from __future__ import annotations

import math

from flodl_bus.coordinator.elche import ElChe, WindowReport
from flodl_bus.coordinator.guard import STABLE, SUPPRESS, Verdict, VerdictKind, merge
from flodl_bus.coordinator.meta import MetaController

NUDGE = VerdictKind.NUDGE_DOWN


def test_a_single_observation_is_noop() -> None:
    mc = MetaController()
    assert mc.observe([0.1, 0.1], 10, STABLE, "stable") is None


def test_probe_phase_is_silent_even_on_an_lr_drop() -> None:
    mc = MetaController()
    mc.observe([0.1, 0.1], 10, STABLE, "probe")
    assert mc.observe([0.01, 0.01], 10, STABLE, "probe") is None


def test_an_lr_drop_of_more_than_30_percent_nudges_by_half_at_a_flat_anchor() -> None:
    mc = MetaController()
    for _ in range(3):
        assert mc.observe([0.1, 0.1], 10, STABLE, "stable") is None
    v = mc.observe([0.01, 0.01], 10, STABLE, "stable")
    assert v == Verdict(NUDGE, 0.5) and mc.fired == ("lr_drop",)


def test_an_lr_fall_of_30_percent_or_less_is_not_a_drop() -> None:
    mc = MetaController()
    mc.observe([0.1], 10, STABLE, "stable")
    assert mc.observe([0.071], 10, STABLE, "stable") is None


def test_one_drop_is_one_nudge() -> None:
    mc = MetaController()
    mc.observe([0.1], 10, STABLE, "stable")
    assert mc.observe([0.01], 10, STABLE, "stable") is not None
    assert mc.observe([0.01], 10, STABLE, "stable") is None
    assert mc.observe([0.01], 10, STABLE, "stable") is None


def test_a_freshly_grown_anchor_is_nudged_further() -> None:
    # anchors 10, 20: mean 15, trend 1/3 -> 0.5 - 0.5 / 3 = 1/3
    mc = MetaController()
    mc.observe([0.1], 10, STABLE, "stable")
    v = mc.observe([0.01], 20, STABLE, "stable")
    assert v is not None and math.isclose(v.factor, 1 / 3)


def test_a_shrunk_anchor_is_nudged_less_and_never_above_095() -> None:
    mc = MetaController()
    for _ in range(4):
        mc.observe([0.1], 100, STABLE, "stable")
    v = mc.observe([0.01], 1, STABLE, "stable")  # mean 80.2, trend -0.99 -> 0.99
    assert v is not None and math.isclose(v.factor, 0.95)


def test_a_gradual_lr_decay_is_not_a_cliff() -> None:
    # each step under 30 % of the previous window's LR, though 0.06 is 33 % under 0.09
    mc = MetaController()
    assert [mc.observe([lr], 10, STABLE, "stable") for lr in (0.1, 0.08, 0.06)] == [None] * 3


def test_the_lr_read_is_the_lowest_live_rank_that_reported_one() -> None:
    mc = MetaController()
    mc.observe([None, 0.1, 0.5], 10, STABLE, "stable")
    assert mc.observe([None, 0.01, 0.5], 10, STABLE, "stable") is not None


def test_nothing_is_observed_before_any_rank_reported_its_lr() -> None:
    mc = MetaController()
    assert [mc.observe([None], 10, SUPPRESS, "mature") for _ in range(3)] == [None] * 3
    assert mc.state() == {"lrs": [], "anchors": [], "verdicts": []}


def test_convergence_needs_k_vetoes_in_a_row_by_phase() -> None:
    for phase, k, base in (("warmup", 5, 0.3), ("stable", 3, 0.5), ("mature", 2, 0.7)):
        mc = MetaController()
        got = [mc.observe([0.1], 10, SUPPRESS, phase) for _ in range(k)]
        assert got[:-1] == [None] * (k - 1), phase
        assert got[-1] == Verdict(NUDGE, base), phase
        assert mc.fired == ("convergence",)


def test_a_stable_verdict_breaks_the_convergence_run() -> None:
    mc = MetaController()
    mc.observe([0.1], 10, SUPPRESS, "stable")
    mc.observe([0.1], 10, SUPPRESS, "stable")
    assert mc.observe([0.1], 10, STABLE, "stable") is None
    assert mc.observe([0.1], 10, SUPPRESS, "stable") is None


def test_convergence_fires_every_window_the_vetoes_go_on() -> None:
    mc = MetaController()
    got = [mc.observe([0.1], 10, SUPPRESS, "stable") for _ in range(5)]
    assert got == [None, None] + [Verdict(NUDGE, 0.5)] * 3


def test_both_detectors_multiply() -> None:
    mc = MetaController()
    mc.observe([0.1], 10, SUPPRESS, "mature")
    v = mc.observe([0.01], 10, SUPPRESS, "mature")
    assert v is not None and math.isclose(v.factor, 0.5 * 0.7)
    assert mc.fired == ("lr_drop", "convergence")


def test_disabled_never_nudges() -> None:
    mc = MetaController(enabled=False)
    mc.observe([0.1], 10, SUPPRESS, "mature")
    assert mc.observe([0.001], 10, SUPPRESS, "mature") is None


def test_merge_meta_nudge_overrides_stable_and_suppress_and_multiplies_a_guard_nudge() -> None:
    nudge = Verdict(NUDGE, 0.5)
    assert merge(STABLE, None) == STABLE
    assert merge(STABLE, nudge) == nudge
    assert merge(SUPPRESS, nudge) == nudge
    assert merge(Verdict(NUDGE, 0.5), Verdict(NUDGE, 0.5)) == Verdict(NUDGE, 0.25)


def test_a_nudge_is_not_clobbered_by_a_pending_growth_proposal() -> None:
    """Reference §6 row 27: the window report proposed growth; the meta-controller's
    NudgeDown in the same finish must discard it and shrink the anchor."""
    el = ElChe(2, anchor=10)
    el.report_window(WindowReport((10.0, 10.0)))
    el.report_window(WindowReport((10.0, 10.0), reduce_ms=100.0))
    assert el.pending_anchor is not None and el.pending_anchor > 10
    el.apply_verdict(merge(STABLE, Verdict(NUDGE, 0.5)))
    assert el.anchor == 5 and el.pending_anchor is None
