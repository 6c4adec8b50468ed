"""Sizing a rank's threads to the work (``worker.threads``): the sweep, the pick, and a
real loop that ends its sweep at the count it kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.protocol.messages import EpochPlan
from flodl_bus.worker.threads import (
    RUNOFF,
    RUNOFF_TIE,
    STOP,
    STOP_MIN_MS,
    TIE,
    ThreadTuner,
    candidates,
    pick,
)
from tests.worker.test_loop import BS, make_rig


def test_candidates_run_from_the_share_down_by_powers_of_two() -> None:
    assert candidates(15) == [15, 8, 4, 2, 1]
    assert candidates(8) == [8, 4, 2, 1]
    assert candidates(7) == [7, 4, 2, 1]
    assert candidates(2) == [2, 1]
    assert candidates(1) == [1]


def _sweep(tuner: ThreadTuner, ms_at: dict[int, float]) -> list[int]:
    """Feeds the tuner the step time of whatever count it runs at; the counts it set."""
    set_to: list[int] = []
    while not tuner.done:
        nxt = tuner.observe(ms_at[tuner.current])
        if nxt is not None:
            set_to.append(nxt)
    return set_to


def test_the_sweep_times_every_candidate_after_the_warm_up_and_keeps_the_fastest() -> None:
    tuner = ThreadTuner(15, warm_steps=4, settle_steps=2, timed_steps=3)
    ms_at = {15: 1.5, 8: 2.1, 4: 1.0, 2: 1.2, 1: 1.4}  # 8 slower, within STOP of 15
    assert ms_at[8] <= STOP * ms_at[15]
    assert ms_at[2] <= RUNOFF * ms_at[4] < ms_at[1]
    # the sweep, then 2 (the fewest that came close) and 4 (the fastest) alternate
    assert _sweep(tuner, ms_at) == [8, 4, 2, 1, 2, 4, 2, 4, 2, 4]
    assert tuner.chosen == 4
    assert tuner.medians == ms_at
    assert tuner.runoff == {2: 1.2, 4: 1.0}
    assert "run-off 2: 1.200 ms, 4: 1.000 ms" in tuner.describe()
    assert "torch threads 4" in tuner.describe()
    assert tuner.observe(9.9) is None  # settled: nothing more to set


def test_a_count_much_slower_than_the_best_ends_the_sweep_for_a_compute_bound_model() -> None:
    tuner = ThreadTuner(15, warm_steps=0, settle_steps=0, timed_steps=2)
    # each halving doubles the step: 4, 2 and 1 threads are never tried
    assert _sweep(tuner, {15: 10.0, 8: 19.0, 4: 38.0, 2: 76.0, 1: 152.0}) == [8, 15]
    assert tuner.medians == {15: 10.0, 8: 19.0}
    assert tuner.chosen == 15


def test_short_steps_sweep_every_count_past_one_that_is_slower_than_its_neighbours() -> None:
    """The 16-core host: 8 threads slower than 15 by more than STOP, 1 the fastest."""
    tuner = ThreadTuner(15, warm_steps=0, settle_steps=0, timed_steps=2)
    ms_at = {15: 1.2, 8: 2.0, 4: 0.9, 2: 0.95, 1: 0.85}
    assert ms_at[8] > STOP * ms_at[15] and ms_at[15] < STOP_MIN_MS
    assert _sweep(tuner, ms_at) == [8, 4, 2, 1]
    assert tuner.medians == ms_at
    assert tuner.chosen == 1


def test_a_count_timed_is_its_steps_median_so_one_stalled_step_does_not_rank_it() -> None:
    tuner = ThreadTuner(2, warm_steps=0, settle_steps=0, timed_steps=3, runoff_blocks=0)
    for ms in (0.5, 40.0, 0.5):  # 2 threads, one step stalled by a round
        tuner.observe(ms)
    for ms in (0.6, 0.6, 0.6):
        tuner.observe(ms)
    assert tuner.medians == {2: 0.5, 1: 0.6}
    assert tuner.chosen == 2


def _feed(tuner: ThreadTuner, ms: Callable[[int, bool], float]) -> int:
    """Feeds the tuner ``ms(count, in_runoff)`` until it settles; the steps it took."""
    steps = 0
    while not tuner.done:
        tuner.observe(ms(tuner.current, tuner.in_runoff))
        steps += 1
    return steps


def test_a_drift_during_the_sweep_is_undone_by_a_run_off_of_the_two_close_counts() -> None:
    """The host slowed while the sweep timed 1 thread (after 4): the run-off times both
    again, alternating, and keeps the fewer, faster in fact."""
    tuner = ThreadTuner(8, warm_steps=0, settle_steps=1, timed_steps=4)
    sweep = {8: 2.0, 4: 1.0, 2: 1.1, 1: 1.15}
    steps = _feed(tuner, lambda n, off: {4: 1.0, 1: 0.9}[n] if off else sweep[n])
    assert tuner.medians == sweep
    assert pick(sweep) == 4  # what the sweep alone would have kept
    assert tuner.runoff == {1: 0.9, 4: 1.0}
    assert tuner.chosen == 1
    # the sweep: 4 counts of 4 timed steps, 3 settles; the run-off: 6 blocks of 2 timed
    # steps, each after a settle but the first (it runs at 1, the sweep's last count)
    assert steps == (4 * 4 + 3) + (6 * 2 + 5)


def test_a_count_that_is_faster_in_fact_wins_its_run_off() -> None:
    tuner = ThreadTuner(4, warm_steps=0, settle_steps=0, timed_steps=4)
    _feed(tuner, lambda n, off: {4: 1.0, 2: 1.3, 1: 1.2}[n])
    assert tuner.runoff == {1: 1.2, 4: 1.0}
    assert tuner.chosen == 4


def test_a_run_off_keeps_the_fewer_threads_unless_the_other_count_is_clearly_faster() -> None:
    # The sweep's 4 looked fastest; in the run-off it is 5% faster than 1: within the
    # run-off's noise, so the fewer is kept. 15% faster: clearly faster, so 4 is kept.
    close = ThreadTuner(4, warm_steps=0, settle_steps=0, timed_steps=4)
    _feed(close, lambda n, off: {4: 1.0, 2: 1.3, 1: 1.05 if off else 1.2}[n])
    clear = ThreadTuner(4, warm_steps=0, settle_steps=0, timed_steps=4)
    _feed(clear, lambda n, off: {4: 1.0, 2: 1.3, 1: 1.15 if off else 1.2}[n])
    assert close.runoff == {1: 1.05, 4: 1.0} and close.chosen == 1
    assert clear.runoff == {1: 1.15, 4: 1.0} and clear.chosen == 4
    assert 1.05 < 1.0 * (1 + RUNOFF_TIE) < 1.15


def test_no_run_off_when_the_fastest_count_is_the_fewest_or_none_came_close() -> None:
    fewest = ThreadTuner(2, warm_steps=0, settle_steps=0, timed_steps=2)
    _feed(fewest, lambda n, off: {2: 0.5, 1: 0.45}[n])
    far = ThreadTuner(2, warm_steps=0, settle_steps=0, timed_steps=2)
    _feed(far, lambda n, off: {2: 0.5, 1: 0.5 * RUNOFF * 1.01}[n])
    assert (fewest.chosen, fewest.runoff) == (1, {})
    assert (far.chosen, far.runoff) == (2, {})


def test_warm_up_steps_are_never_timed() -> None:
    tuner = ThreadTuner(2, warm_steps=5, settle_steps=0, timed_steps=2)
    for _ in range(5):
        assert tuner.observe(100.0) is None
    assert tuner.medians == {}
    tuner.observe(1.0)
    assert tuner.observe(1.0) == 1
    assert tuner.medians == {2: 1.0}


def test_the_pick_takes_the_fewest_threads_within_the_tie_of_the_fastest() -> None:
    assert pick({15: 1.00, 8: 1.00 * (1 + TIE / 2), 4: 1.5}) == 8
    assert pick({15: 1.00, 8: 1.00 * (1 + 2 * TIE)}) == 15
    assert pick({2: 0.9, 1: 0.9}) == 1


def test_a_share_of_one_thread_has_nothing_to_size() -> None:
    tuner = ThreadTuner(1)
    assert tuner.done and tuner.chosen == 1
    assert tuner.observe(1.0) is None


def test_a_loop_with_a_tuner_trains_through_the_sweep_and_keeps_the_count_it_chose() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the share the rank set before its first step
    said: list[ThreadTuner] = []
    seen: list[int] = []  # the count each step's loss ran at

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return digits.job.loss_fn(model, batch)

    tuner = ThreadTuner(2, warm_steps=2, settle_steps=1, timed_steps=3, runoff_blocks=0)
    rig = make_rig(dataclasses.replace(digits.job, loss_fn=loss_fn), threads=tuner,
                   on_threads=said.append)  # fmt: skip
    try:
        assert rig.loop.run_epoch_plan(EpochPlan(0, 0, 12 * BS)) is False
        assert tuner.done and set(tuner.medians) == {2, 1}
        # the sweep really ran at each count: 2 for the warm-up and its timed steps, 1 for
        # the rest of the sweep, then the count kept
        assert seen[:5] == [2] * 5 and seen[5:9] == [1] * 4
        assert seen[9:] == [tuner.chosen] * 3
        assert torch.get_num_threads() == tuner.chosen
        assert said == [tuner]  # told once
        assert rig.loop.threads is None
        assert rig.control.local_step == 12  # every step of the sweep trained
    finally:
        torch.set_num_threads(before)
