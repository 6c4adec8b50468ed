"""flodl's controllers wired into the core: the meta-controller reads the ranks'
LrUpdates, the configured guard judges each window, callback slack and speed hints
shape the windows (reference §4.6.2, §4.9, §4.10.2, §4.13.4)."""

from __future__ import annotations

from typing import Any

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Alert, Out
from flodl_bus.coordinator.guard import MsfGuard, NoGuard, TrendGuard, VerdictKind
from flodl_bus.coordinator.ledger import Ledger
from flodl_bus.protocol import messages as m


def make(mode: str = "cpu-cadence", ws: int = 2, **kw: Any) -> Coordinator:
    kw.setdefault("num_epochs", 1)
    kw.setdefault("total_samples", 10_000)
    return Coordinator(CoordinatorConfig(mode=mode, world_size=ws, batch_size=1, **kw))


def window(core: Coordinator, lr: float, ms: tuple[float, ...] = (10.0, 10.0)) -> list[Out]:
    """One closed window: every rank reported its LR and trained a few batches."""
    closed = Ledger(core.ws)
    for r in range(core.ws):
        core.handle(r, m.LrUpdate(r, lr), 0.0)
        for _ in range(3):
            closed.record_batch(r, ms[r], 0.0, 0.5)
    out: list[Out] = []
    core.reduce.close_window(closed, 0.0, out)
    return out


def test_an_lr_drop_reported_by_the_ranks_shrinks_the_anchor_by_default() -> None:
    core = make(anchor=20)
    for _ in range(3):
        window(core, 0.1)
    assert core.elche.anchor == 20
    out = window(core, 0.01)
    assert core.last_verdict.kind is VerdictKind.NUDGE_DOWN
    assert core.elche.anchor == 10 and core.meta.fired == ("lr_drop",)
    # flodl's drift alert names the shrink and its source
    assert out == [Alert("warn", "drift", "anchor 20 -> 10 (lr_drop)")]
    assert window(core, 0.01) == []


def test_the_meta_controller_can_be_turned_off() -> None:
    core = make(anchor=20, meta_controller=False)
    for lr in (0.1, 0.1, 0.1, 0.01):
        window(core, lr)
    assert core.elche.anchor == 20 and core.last_verdict.kind is not VerdictKind.NUDGE_DOWN


def test_a_dead_ranks_stale_lr_is_not_read() -> None:
    core = make(ws=3, anchor=20)
    core.handle(2, m.LrUpdate(2, 1.0), 0.0)
    core.declare_dead(2, 0.0)
    for lr in (1.0, 1.0, 1.0, 0.6):
        closed = Ledger(3)
        for r in (0, 1):
            core.handle(r, m.LrUpdate(r, lr), 0.0)
            closed.record_batch(r, 10.0, 0.0, 0.5)
        core.reduce.close_window(closed, 0.0, [])
    # 1.0 -> 0.6 is a 40 % drop; with the dead rank's 1.0 averaged in it would be 27 %
    assert core.meta.fired == ("lr_drop",)


def test_guard_is_chosen_by_config_and_msf_can_shrink_the_anchor() -> None:
    assert isinstance(make().guard, TrendGuard)
    assert isinstance(make(guard="none").guard, NoGuard)
    core = make(anchor=40, guard="msf", meta_controller=False)
    assert isinstance(core.guard, MsfGuard)
    for i in range(5):
        core.reduce.divergence = [0.01 * 1.5**i, 0.01 * 1.5**i]
        window(core, 0.1)
    assert core.elche.anchor == 20


def test_unknown_guard_is_refused_naming_the_choices() -> None:
    try:
        make(guard="bogus")
    except ValueError as e:
        assert "trend, msf, none" in str(e)
    else:
        raise AssertionError("guard='bogus' was accepted")


def slack_core(ewma_ms: float | None, **kw: Any) -> Coordinator:
    # one epoch of 40 batches: after the probe window the pool holds < sum(counts)
    core = make(total_samples=40, epoch_callback_rank=0, **kw)
    core.start(0.0)
    if ewma_ms is not None:
        core.handle(0, m.EpochFnElapsed(0, 0, ewma_ms), 0.0)
    return core


def test_callback_slack_shortens_the_callback_ranks_last_window_of_the_epoch() -> None:
    core = slack_core(ewma_ms=150.0)
    window(core, 0.1, ms=(10.0, 20.0))  # calibrates: counts [20, 10]
    assert core.elche.counts == [20, 10]
    pool = core.dispatch.epoch_remaining()
    assert pool is not None and 0 < pool <= 30
    window(core, 0.1, ms=(10.0, 20.0))
    # 150 ms >= max(5% of a 10 x 20 ms window, 100 ms): ceil(150 / 10) batches off rank 0
    assert core.elche.counts == [5, 10]


def test_callback_slack_below_its_threshold_or_off_changes_nothing() -> None:
    for core in (slack_core(ewma_ms=50.0), slack_core(300.0, callback_slack=False)):
        window(core, 0.1, ms=(10.0, 20.0))
        window(core, 0.1, ms=(10.0, 20.0))
        assert core.elche.counts == [20, 10]


def test_speed_hints_size_the_first_partition_and_the_first_counts() -> None:
    core = make(progressive=False, speed_hints=(3.0, 1.0), total_samples=400)
    out = core.start(0.0)
    sizes = {o.rank: o.msg.plan.partition_size for o in out if isinstance(o.msg, m.StartEpoch)}
    assert sizes == {0: 300, 1: 100}
    assert core.elche.counts == [30, 10]


def test_speed_hints_need_one_positive_entry_per_rank() -> None:
    for bad in ((1.0,), (1.0, 0.0)):
        try:
            make(speed_hints=bad)
        except ValueError as e:
            assert "speed_hints" in str(e)
        else:
            raise AssertionError(f"speed_hints={bad} was accepted")


# ------------------------------------------------------------------ stage advisories
def advisories(out: list[Any]) -> dict[int, m.StageAdvisory]:
    return {o.rank: o.msg for o in out if isinstance(o.msg, m.StageAdvisory)}


def test_epoch_start_advises_each_rank_its_span_the_tails_it_may_steal_and_the_next_epoch() -> None:
    # chunks of one window each, as every chunk was before they crossed windows
    core = make(total_samples=200, num_epochs=2, stage_advisories=True, chunks_cross_windows=False)
    out = core.start(0.0)
    kinds = [type(o.msg).__name__ for o in out if hasattr(o, "msg")]
    # each rank's advisory follows the StartEpochs of the epoch it describes
    assert kinds.index("StageAdvisory") > max(i for i, k in enumerate(kinds) if k == "StartEpoch")
    adv = advisories(out)
    assert set(adv) == {0, 1} and adv[0].counts == (10, 10)
    # epoch 0: spans [0,100) and [100,200); each rank took a 10-batch probe chunk
    assert adv[0].segments[0] == (0, ((10, 90), (190, 10)))
    assert adv[1].segments[0] == (0, ((110, 90), (90, 10)))
    assert adv[0].segments[1] == (1, ((0, 100),)) and adv[1].segments[1] == (1, ((100, 100),))


def test_every_reduce_re_advises_and_a_dead_rank_is_not_advised() -> None:
    core = make(ws=3, total_samples=300, stage_advisories=True)
    core.start(0.0)
    core.declare_dead(2, 0.0)
    out: list[Any] = []
    core.reduce.after_window(0.0, out)
    assert set(advisories(out)) == {0, 1}


def test_advisories_are_off_by_default_and_absent_for_a_fixed_partition() -> None:
    assert advisories(make().start(0.0)) == {}
    assert advisories(make(progressive=False, stage_advisories=True).start(0.0)) == {}


def test_relax_up_grows_the_cpu_async_anchor_by_one_per_stable_reduce() -> None:
    core = make("cpu-async", anchor=10, relax_up=True, meta_controller=False)
    for _ in range(3):
        window(core, 0.1)
    assert core.last_verdict.kind is VerdictKind.STABLE
    assert core.elche.anchor == 13


def test_relax_up_is_off_by_default_and_never_lengthens_cadence_windows() -> None:
    default = make("cpu-async", anchor=10, meta_controller=False)
    cadence = make("cpu-cadence", anchor=10, relax_up=True, meta_controller=False)
    for core in (default, cadence):
        for _ in range(3):
            window(core, 0.1)
        assert core.elche.anchor == 10


def test_relax_up_waits_while_the_guard_vetoes_growth() -> None:
    core = make("cpu-async", anchor=10, relax_up=True, meta_controller=False)
    for i in range(4):
        # Divergence rising above the async threshold (0.3) three windows running.
        core.reduce.divergence = [0.3 + 0.1 * i, 0.3 + 0.1 * i]
        window(core, 0.1)
    assert core.last_verdict.kind is VerdictKind.SUPPRESS_GROWTH
    assert core.elche.anchor == 12  # two Stable windows before the climb was seen


def test_callback_slack_adds_an_eval_due_at_the_epochs_end_to_its_ranks_window() -> None:
    for every, counts in ((1, [8, 10]), (2, [20, 10])):
        core = slack_core(ewma_ms=60.0, eval_every=every)  # 60 ms alone is under 100
        core.handle(0, m.EvalResult(0, 0, 0, 0.9, 60.0), 0.0)
        window(core, 0.1, ms=(10.0, 20.0))
        window(core, 0.1, ms=(10.0, 20.0))
        # epoch 1 is due under every=1: 60 + 60 ms, ceil(120 / 10) batches off rank 0
        assert core.elche.counts == counts


def test_callback_slack_shortens_the_checkpoint_ranks_window_when_one_is_due() -> None:
    core = slack_core(ewma_ms=None, checkpoint_every=1)
    core.handle(0, m.CheckpointResult(0, 1, 5.0, "disk full"), 0.0)  # role fails over
    core.handle(1, m.CheckpointResult(1, 1, 150.0), 0.0)
    assert core.roles.checkpoint == 1 and core.roles.epoch_callback == 0
    window(core, 0.1, ms=(10.0, 20.0))
    window(core, 0.1, ms=(10.0, 20.0))
    assert core.elche.counts == [20, 2]  # ceil(150 / 20) = 8 off the anchor's 10


def test_an_lr_nudge_then_the_guards_stable_relaxes_async_and_grows_its_overshoot() -> None:
    """flodl's order (issue 29): the meta-controller's nudge applies, then the guard's
    Stable as if alone: the overshoot budget grows (the nudge never resets it), relax-up
    adds one batch after the nudge, and the Stable counts toward re-arming growth. The
    records made before replay the merged verdict: one nudge, overshoot back to its
    start, no relax-up, no Stable counted."""
    from flodl_bus.coordinator.reduce import OVERSHOOT_START

    runs = {}
    for order in (True, False):
        core = make("cpu-async", anchor=20, relax_up=True, meta_then_guard=order)
        for _ in range(3):
            window(core, 0.1)
        before = core.max_overshoot
        window(core, 0.01)  # a 90 % LR drop: the meta-controller nudges the anchor down
        assert core.meta.fired == ("lr_drop",)
        runs[order] = (core.elche.anchor, core.max_overshoot, core.elche._stable_streak, before)
    (flodl_anchor, flodl_over, flodl_streak, before), (old_anchor, old_over, old_streak, _) = (
        runs[True],
        runs[False],
    )
    assert flodl_anchor == old_anchor + 1 < 20
    assert flodl_over == before + 1 and old_over == OVERSHOOT_START
    assert (flodl_streak, old_streak) == (1, 0)


def test_two_nudges_in_one_window_apply_one_after_the_other_each_clamped() -> None:
    from flodl_bus.coordinator.elche import ElChe
    from flodl_bus.coordinator.guard import Verdict, merge

    meta, guard = Verdict(VerdictKind.NUDGE_DOWN, 0.1), Verdict(VerdictKind.NUDGE_DOWN, 0.1)
    flodl, merged = ElChe(2, anchor=100), ElChe(2, anchor=100)
    flodl.apply_verdict(meta)
    flodl.apply_verdict(guard)
    merged.apply_verdict(merge(guard, meta))
    assert (flodl.anchor, merged.anchor) == (1, 10)  # 100 -> 10 -> 1; one factor >= 0.1
